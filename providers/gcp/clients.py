"""The google-cloud-compute REST clients one GCP provider object shares, built on first use.

With `gcp_endpoint_url` set (a local stand-in of the Compute API) the clients talk to it with
anonymous credentials; otherwise they use Application Default Credentials against
compute.googleapis.com. Building is lazy so that a provider object can exist (offerings,
regions) on a machine without GCP credentials; a missing credential surfaces as AuthError on
the first call that needs one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.api_core import exceptions as api_exceptions
from google.api_core import retry as api_retry
from google.auth.credentials import AnonymousCredentials, Credentials
from google.cloud import compute_v1

from meridian.settings.providers import ProviderSettings
from providers.gcp.errors import map_error

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ComputeClients:
    """One client per Compute resource the GCP provider calls."""

    migs: compute_v1.RegionInstanceGroupManagersClient
    region_operations: compute_v1.RegionOperationsClient
    zone_operations: compute_v1.ZoneOperationsClient
    templates: compute_v1.InstanceTemplatesClient  # global templates (a MIG made by hand may use one)
    region_templates: compute_v1.RegionInstanceTemplatesClient  # iac's templates
    regions: compute_v1.RegionsClient


def build_clients(settings: ProviderSettings) -> ComputeClients:
    """REST clients for the settings' endpoint (anonymous) or Google's (Application Default Credentials)."""
    kwargs: dict[str, Any] = {"transport": "rest"}
    if settings.gcp_endpoint_url:
        credentials: Credentials = AnonymousCredentials()  # type: ignore[no-untyped-call]
        kwargs["credentials"] = credentials
        kwargs["client_options"] = {"api_endpoint": settings.gcp_endpoint_url}
    return ComputeClients(
        migs=compute_v1.RegionInstanceGroupManagersClient(**kwargs),
        region_operations=compute_v1.RegionOperationsClient(**kwargs),
        zone_operations=compute_v1.ZoneOperationsClient(**kwargs),
        templates=compute_v1.InstanceTemplatesClient(**kwargs),
        region_templates=compute_v1.RegionInstanceTemplatesClient(**kwargs),
        regions=compute_v1.RegionsClient(**kwargs),
    )


def read_retry(timeout_s: float) -> api_retry.Retry:
    """Retry of idempotent reads on 503/deadline errors, bounded by one call's timeout (the SDK's
    default retries them for 600 s)."""
    return api_retry.Retry(
        initial=0.1,
        maximum=2.0,
        multiplier=2.0,
        timeout=timeout_s,
        predicate=api_retry.if_exception_type(
            api_exceptions.ServiceUnavailable, api_exceptions.DeadlineExceeded
        ),
    )


class LazyClients:
    """Builds the clients once, on the first `get()` (thread-safe: calls run in worker threads)."""

    def __init__(self, settings: ProviderSettings) -> None:
        self._settings = settings
        self._clients: ComputeClients | None = None
        self._lock = threading.Lock()

    def get(self) -> ComputeClients:
        with self._lock:
            if self._clients is None:
                self._clients = build_clients(self._settings)
            return self._clients


async def call(clients: LazyClients, where: str, fn: Callable[[ComputeClients], T]) -> T:
    """Run one blocking SDK call in a worker thread; any failure comes back as a typed ProviderError."""
    try:
        return await asyncio.to_thread(lambda: fn(clients.get()))
    except Exception as e:
        raise map_error(e, where) from e


async def call_or_none(
    clients: LazyClients,
    where: str,
    fn: Callable[[ComputeClients], T],
    absent: tuple[type[api_exceptions.GoogleAPICallError], ...] = (api_exceptions.NotFound,),
) -> T | None:
    """Like `call`, but None when the API answers with one of `absent` (by default 404 Not Found)."""
    try:
        return await asyncio.to_thread(lambda: fn(clients.get()))
    except absent:
        return None
    except Exception as e:
        raise map_error(e, where) from e
