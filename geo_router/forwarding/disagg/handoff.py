"""The prefill hop: one request's prompt prefilled on a worker of the region's prefill pool.

The prefill request is sent like any other node call (geo_router.forwarding.node_call: the cluster
token, a bounded slot, a pooled connection) and answered whole. Its outcomes:

- 200 with `kv_transfer_params` for a decode worker: a Handoff, leased for as long as the
  prefill worker keeps the blocks (its KVTransferInfo.lease_s).
- 4xx other than 408/429: the request's own fault (too long, a bad parameter); the decode
  worker would refuse it the same way, so it is the client's answer (`Refused`).
- 5xx, 408, 429, no answer, an answer without usable params: that worker failed; the next
  of the pool is tried, up to `pd_prefill_attempts` and within `pd_prefill_timeout_s`.
  The failure counts towards the node's ejection as any other does.
- No worker prefilled: None, and the decode worker prefills the prompt itself.

A hand-off nobody will pull is released, so that the prefill worker does not hold its
blocks to the lease's end: the torch engine's connector has `DELETE /v1/kv/{id}`; vLLM's
NIXL connector has no such call and frees them when its abort timeout (the lease) passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import msgspec

from meridian.clock import Clock
from meridian.contracts import KVConnector
from meridian.kv_transfer import KVTransferError, decode_params
from meridian.settings.router import RouterSettings

from ...observability.metrics import RouterMetrics
from ...selection.candidates import Candidate
from ..node_call import NodeCaller
from ..upstream import FailureReason, UpstreamError

log = logging.getLogger(__name__)

# Statuses of a prefill answer that are the worker's trouble, not the request's.
_WORKER_STATUSES = (408, 429)
_RELEASE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Handoff:
    """A prompt's KV held by a prefill worker for the decode worker to pull."""

    params: dict[str, Any]
    prefill: Candidate
    at: float  # the router clock's monotonic time of the prefill answer
    lease_s: float

    def expired(self, now: float) -> bool:
        return now - self.at >= self.lease_s


@dataclass(frozen=True, slots=True)
class Refused:
    """The prefill worker refused the request itself: the client's answer."""

    status: int
    body: bytes
    headers: dict[str, str]


class PrefillHost(Protocol):
    """What the prefill hop needs of the forwarder that hosts it."""

    def is_ejected(self, node_id: str) -> bool: ...

    def note_failure(self, candidate: Candidate, reason: FailureReason) -> None: ...

    def prefill_began(self, candidate: Candidate) -> None: ...

    def prefill_ended(self, candidate: Candidate, ok: bool) -> None: ...


class Prefiller:
    """Runs prefill hops and releases hand-offs, for one router."""

    def __init__(self, settings: RouterSettings, calls: NodeCaller, host: PrefillHost, metrics: RouterMetrics,
                 clock: Clock) -> None:
        self._settings = settings
        self._calls = calls
        self._host = host
        self._metrics = metrics
        self._clock = clock
        self._releasing: set[asyncio.Task[None]] = set()

    async def prefill(self, route: str, body: bytes, pool: Sequence[Candidate], request_id: str,
                      deadline: float, trace_headers: str = "") -> Handoff | Refused | None:
        """Prefill on the first worker of `pool` that can (see the module doc)."""
        s = self._settings
        loop = asyncio.get_running_loop()
        until = min(deadline, loop.time() + s.pd_prefill_timeout_s)
        tried = 0
        for candidate in pool:
            if tried >= s.pd_prefill_attempts or loop.time() >= until:
                break
            if self._host.is_ejected(candidate.node.node_id):
                continue
            tried += 1
            started = time.perf_counter()
            outcome = await self._one(route, body, candidate, request_id, until, trace_headers)
            region = candidate.region.name
            if isinstance(outcome, FailureReason):
                self._metrics.pd_prefills.labels(region, candidate.node.node_id, "failed").inc()
                continue
            self._metrics.pd_prefill_latency.labels(region).observe(time.perf_counter() - started)
            self._metrics.pd_prefills.labels(region, candidate.node.node_id,
                                             "refused" if isinstance(outcome, Refused) else "ok").inc()
            return outcome
        return None

    async def _one(self, route: str, body: bytes, candidate: Candidate, request_id: str, until: float,
                   trace_headers: str) -> Handoff | Refused | FailureReason:
        self._host.prefill_began(candidate)
        ok = False
        try:
            answered = await self._exchange(route, body, candidate, request_id, until, trace_headers)
            if isinstance(answered, FailureReason):
                return answered
            status, content_type, answer = answered
            if status >= 500 or status in _WORKER_STATUSES:
                return self._failed(candidate, FailureReason.SERVER_ERROR if status >= 500 else None,
                                    f"HTTP {status}")
            if status >= 300:
                ok = True  # the node is fine; the request is not
                return Refused(status, answer, content_type)
            try:
                params = decode_params(msgspec.json.decode(answer))
            except (msgspec.DecodeError, KVTransferError) as exc:
                return self._failed(candidate, FailureReason.PROTOCOL, str(exc))
            ok = True
            transfer = candidate.node.kv_transfer
            lease_s = transfer.lease_s if transfer is not None else self._settings.pd_prefill_timeout_s
            return Handoff(params, candidate, self._clock.monotonic(), lease_s)
        finally:
            self._host.prefill_ended(candidate, ok)

    async def _exchange(self, route: str, body: bytes, candidate: Candidate, request_id: str, until: float,
                        trace_headers: str) -> tuple[int, dict[str, str], bytes] | FailureReason:
        """The prefill request's status, content type and whole answer, or why there is none."""
        try:
            status, headers, answer = await self._calls.whole(candidate.node.url, "POST", route, body, until,
                                                              request_id=request_id, trace_headers=trace_headers)
        except ValueError as exc:  # the node's URL
            return self._failed(candidate, FailureReason.PROTOCOL, str(exc))
        except UpstreamError as exc:
            return self._failed(candidate, exc.reason, str(exc))
        except TimeoutError:
            return self._failed(candidate, FailureReason.TIMEOUT, "no prefill answer in time")
        return status, _content_type(headers), answer

    def _failed(self, candidate: Candidate, reason: FailureReason | None, detail: str) -> FailureReason:
        log.warning("prefill on %s failed (%s); trying the next prefill worker", candidate.node.node_id, detail)
        if reason is not None:
            self._host.note_failure(candidate, reason)
            return reason
        return FailureReason.SERVER_ERROR

    def release(self, handoff: Handoff) -> None:
        """Let the prefill worker free a hand-off's blocks now (in the background)."""
        transfer = handoff.prefill.node.kv_transfer
        handle = handoff.params.get("remote_request_id")
        if transfer is None or transfer.connector is not KVConnector.MERIDIAN or not isinstance(handle, str):
            return  # NIXL frees them when its lease passes
        task = asyncio.get_running_loop().create_task(self._delete(handoff.prefill, handle))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _delete(self, candidate: Candidate, handle: str) -> None:
        deadline = asyncio.get_running_loop().time() + _RELEASE_TIMEOUT_S
        try:
            await self._calls.whole(candidate.node.url, "DELETE", "/v1/kv/" + quote(handle, safe=""), b"", deadline)
        except Exception as exc:  # noqa: BLE001 — best effort: the lease frees them anyway
            log.info("releasing KV %s on %s: %s", handle, candidate.node.node_id, exc)

    async def aclose(self) -> None:
        for task in list(self._releasing):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _content_type(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    for name, value in headers:
        if name == b"content-type":
            return {"content-type": value.decode("latin-1")}
    return {}

