"""A decode node pulls a prompt's KV from the prefill node its `kv_transfer_params` name.

`GET http://{remote_host}:{remote_port}/v1/kv/{remote_request_id}` with the cluster token,
over one pooled client, within PULL_TIMEOUT and at most the bytes the prompt's KV can take
in this node's layout; the payload must then fit (payload.mismatch). Any failure (params
malformed, handle unknown or expired, peer unreachable, payload too big, bad or for another
model or prompt) is logged and counted, and the request goes on without it: the prompt is
computed here (vLLM's kv_load_failure_policy "recompute"). A decode never fails because its
prefill did.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
from collections.abc import Callable
from typing import Any

import httpx

from data_plane.engine.kv_transfer.payload import KVLayout, KVPayload, KVPayloadError, decode, mismatch
from meridian.settings.node import NodeSettings

log = logging.getLogger(__name__)

PULL_TIMEOUT = httpx.Timeout(30.0, connect=3.0)
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*|[A-Za-z0-9][A-Za-z0-9._-]{0,252})$")
_HANDLE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class PullOutcome(enum.StrEnum):
    OK = "ok"
    MALFORMED = "malformed_params"
    NOT_FOUND = "not_found"
    UNREACHABLE = "unreachable"
    TOO_LARGE = "too_large"
    BAD_PAYLOAD = "bad_payload"
    MISMATCH = "mismatch"


class _Failed(Exception):
    def __init__(self, outcome: PullOutcome, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


def pull_url(params: dict[str, Any]) -> str:
    """The export URL named by decode params; _Failed(MALFORMED) when they name none."""
    host, port, handle = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    if not isinstance(host, str) or not _HOST.match(host):
        raise _Failed(PullOutcome.MALFORMED, f"remote_host {host!r} is not a host name or address")
    if type(port) is not int or not 0 < port < 65536:
        raise _Failed(PullOutcome.MALFORMED, f"remote_port {port!r} is not a port")
    if not isinstance(handle, str) or not _HANDLE.match(handle):
        raise _Failed(PullOutcome.MALFORMED, "remote_request_id is not a KV handle")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/v1/kv/{handle}"


class KVPuller:
    """The decode node's client for peers' held KV."""

    def __init__(self, settings: NodeSettings, layout: Callable[[], KVLayout], *,
                 on_outcome: Callable[[PullOutcome], None] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        token = settings.cluster_token
        self._headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        self._layout = layout
        self._on_outcome = on_outcome or (lambda _: None)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                headers=self._headers, timeout=PULL_TIMEOUT, transport=self._transport,
                limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
            )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def pull(self, params: dict[str, Any], prompt_ids: list[int], lora: str | None) -> KVPayload | None:
        """The prompt's KV from the prefill node, checked to fit; None (logged) when it
        cannot be had, and the prompt is to be computed here."""
        url = "?"
        try:
            url = pull_url(params)
            layout = self._layout()
            data = await self._fetch(url, layout.payload_bytes(len(prompt_ids)))
            try:
                payload = await asyncio.to_thread(decode, data)
            except KVPayloadError as exc:
                raise _Failed(PullOutcome.BAD_PAYLOAD, str(exc)) from None
            reason = mismatch(payload, layout, prompt_ids, lora)
            if reason is not None:
                raise _Failed(PullOutcome.MISMATCH, reason)
        except _Failed as failed:
            log.warning("KV pull from %s failed (%s: %s): computing the prompt here", url,
                        failed.outcome.value, failed)
            self._on_outcome(failed.outcome)
            return None
        self._on_outcome(PullOutcome.OK)
        return payload

    async def _fetch(self, url: str, limit: int) -> bytearray:
        try:
            async with self._http().stream("GET", url) as resp:
                if resp.status_code == 404:
                    raise _Failed(PullOutcome.NOT_FOUND, "the prefill node holds no such KV (expired?)")
                if resp.status_code != 200:
                    raise _Failed(PullOutcome.UNREACHABLE, f"the prefill node answered {resp.status_code}")
                length = resp.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > limit:
                    raise _Failed(PullOutcome.TOO_LARGE, f"{length} bytes, at most {limit} expected")
                data = bytearray()
                async for chunk in resp.aiter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise _Failed(PullOutcome.TOO_LARGE, f"over {limit} bytes")
                return data
        except httpx.HTTPError as exc:
            raise _Failed(PullOutcome.UNREACHABLE, f"{type(exc).__name__}: {exc}") from None
