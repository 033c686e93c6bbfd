"""boto3 clients per (service, region), and the one way this package calls them.

boto3 blocks, so every call runs in a worker thread (`asyncio.to_thread`) bounded by
`call_timeout_s`; botocore's own connect/read timeouts are the same bound, so a thread whose
caller gave up does not hang on. Failures come back as the providers' typed errors
(providers.aws.errors.map_error).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import boto3
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from meridian.settings.providers import ProviderSettings
from providers.aws.errors import PROVIDER, map_error
from providers.errors import ProviderError

# Attempts per call in botocore's standard retry mode (throttling, 5xx, connection errors);
# the reconciler retries whole steps with its own backoff, so a call need not try hard.
MAX_ATTEMPTS = 3


def location(region: str) -> str:
    """AWS's name of a Meridian region: "aws:us-east-1" → "us-east-1"."""
    provider, _, loc = region.partition(":")
    if provider != PROVIDER or not loc:
        raise ProviderError(f"{region!r} is not an AWS region (expected 'aws:<region>')", provider=PROVIDER)
    return loc


class AwsClients:
    """Lazily created, shared boto3 clients (thread-safe once made) of one set of settings.

    Credentials come from boto3's usual chain (environment, profile, instance role), unless a
    `session` is given; `settings.aws_endpoint_url` points every client at a stand-in (moto).
    """

    def __init__(self, settings: ProviderSettings, session: boto3.session.Session | None = None) -> None:
        self._settings = settings
        self._session = session
        self._clients: dict[tuple[str, str], BaseClient] = {}
        # boto3 sessions are not thread-safe; clients are. Creating one takes the lock.
        self._lock = threading.Lock()
        self._config = Config(
            connect_timeout=settings.call_timeout_s,
            read_timeout=settings.call_timeout_s,
            retries={"mode": "standard", "max_attempts": MAX_ATTEMPTS},
            user_agent_extra="meridian",
        )

    @property
    def settings(self) -> ProviderSettings:
        return self._settings

    def client(self, service: str, aws_region: str) -> BaseClient:
        """The client of `service` in `aws_region` (blocking: call it from a worker thread)."""
        key = (service, aws_region)
        with self._lock:
            found = self._clients.get(key)
            if found is None:
                if self._session is None:
                    self._session = boto3.session.Session()
                found = self._session.client(
                    service, region_name=aws_region, endpoint_url=self._settings.aws_endpoint_url, config=self._config
                )
                self._clients[key] = found
            return found

    async def call(
        self,
        service: str,
        aws_region: str,
        operation: str,
        *,
        action: str,
        instance_type: str | None = None,
        paginate: bool = False,
        **params: Any,
    ) -> dict[str, Any]:
        """`operation` (boto3's method name) of `service` with `params`; with `paginate`, every
        page merged into one answer. `action` and `instance_type` name the failure in errors."""

        def run() -> dict[str, Any]:
            client = self.client(service, aws_region)
            if paginate:
                result: dict[str, Any] = client.get_paginator(operation).paginate(**params).build_full_result()
                return result
            answer: dict[str, Any] = getattr(client, operation)(**params)
            return answer

        try:
            async with asyncio.timeout(self._settings.call_timeout_s):
                return await asyncio.to_thread(run)
        except (BotoCoreError, ClientError, ResponseParserError, TimeoutError) as e:
            raise map_error(e, action=action, region=aws_region, instance_type=instance_type) from e

    def close(self) -> None:
        """Close every client's connection pool."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
