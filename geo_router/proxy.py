"""Forwarding a request to a replica, failing over to the next one before the first byte.

Once anything has been sent to the client the choice of replica is final: a streamed
answer whose upstream breaks ends with one `data: {"error": ...}` SSE event instead.
For streams, the first complete SSE event is read from the node before the client gets
its status line, so a node that accepts the request and dies during prefill is still
failed over. Events are forwarded whole, so a break never leaves half an event behind.

`x-meridian-overhead-ms` is the time spent in the router itself between having received
the request body and sending the request to the node that served it, minus the time
spent waiting on replicas that failed: what this router adds, not what failover costs
(failovers show in `meridian_router_failovers` and the latency histogram).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from meridian.contracts import (
    HEADER_NODE,
    HEADER_OVERHEAD_MS,
    HEADER_REGION,
    HEADER_REQUEST_ID,
    openai_error,
)
from meridian.settings import RouterSettings

from .errors import RouterError, RouterOverloaded, UpstreamTimeout
from .health import FleetState
from .metrics import RouterMetrics
from .request import InferenceRequest
from .selection import Candidate

log = logging.getLogger(__name__)

# Upstream headers worth keeping; hop-by-hop and length/encoding headers are the router's.
_PASSTHROUGH_HEADERS = ("content-type", "retry-after", "cache-control")


def make_upstream_client(settings: RouterSettings) -> httpx.AsyncClient:
    """The one pooled client the router uses to reach every node."""
    n = settings.max_upstream_connections
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=30.0),
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.read_timeout_s,
            pool=settings.connect_timeout_s,
        ),
        follow_redirects=False,
        # Node traffic is cluster-internal: an HTTP(S)_PROXY in the environment must not
        # capture it.
        trust_env=False,
    )


class _NodeFailed(Exception):
    """The attempt failed because of the node; the next candidate may be tried."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _SSEFramer:
    """Releases only complete SSE events, holding back a trailing partial one."""

    def __init__(self, is_sse: bool) -> None:
        self._is_sse = is_sse
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self._is_sse:
            return chunk
        # Only the new bytes (and a separator straddling the old tail) can end an event.
        search_from = max(0, len(self._buf) - 3)
        self._buf += chunk
        end = 0
        for sep in (b"\n\n", b"\r\n\r\n"):
            at = self._buf.rfind(sep, search_from)
            if at >= 0:
                end = max(end, at + len(sep))
        if end == 0:
            return b""
        out, self._buf = self._buf[:end], self._buf[end:]
        return out

    def flush(self) -> bytes:
        out, self._buf = self._buf, b""
        return out


def _error_event(message: str, code: str) -> bytes:
    body = openai_error(message, type_="server_error", code=code)
    return b"data: " + json.dumps(body).encode("utf-8") + b"\n\n"


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return "connect"
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return "timeout"
    return "protocol"


class _UpstreamStream:
    """A committed streamed answer: its node's response, and how to pass it on and close it."""

    def __init__(
        self,
        forwarder: UpstreamForwarder,
        candidate: Candidate,
        resp: httpx.Response,
        chunks: AsyncIterator[bytes],
        framer: _SSEFramer,
        first: bytes,
        ended: bool,
        deadline: float,
        received_at: float,
    ) -> None:
        self._fw = forwarder
        self._candidate = candidate
        self._resp = resp
        self._chunks = chunks
        self._framer = framer
        self._first = first
        self._ended = ended
        self._deadline = deadline
        self._received_at = received_at
        self._closed = False

    async def body(self) -> AsyncIterator[bytes]:
        if self._first:
            yield self._first
        if self._ended:
            return
        while True:
            try:
                async with asyncio.timeout_at(self._deadline):
                    chunk = await anext(self._chunks)
            except StopAsyncIteration:
                tail = self._framer.flush()
                if tail:
                    yield tail
                return
            except (httpx.HTTPError, httpx.StreamError, TimeoutError) as exc:
                reason = _failure_reason(exc)
                node = self._candidate.node.node_id
                log.warning("node %s broke a stream (%s: %s)", node, reason, exc)
                self._fw.note_failure(self._candidate, "midstream")
                yield _error_event(
                    f"The model server stopped responding in the middle of the answer ({reason}).",
                    "upstream_disconnected",
                )
                return
            out = self._framer.feed(chunk)
            if out:
                yield out

    async def close(self) -> None:
        """Release the upstream connection (also when the client went away); idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._resp.aclose()
        self._fw.finish(self._candidate, time.perf_counter() - self._received_at)


class _UpstreamStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its upstream, however the client leaves."""

    def __init__(self, stream: _UpstreamStream, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(stream.body(), status_code=status_code, headers=headers)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                body = self.body_iterator
                if hasattr(body, "aclose"):
                    await body.aclose()
                await self._stream.close()


class UpstreamForwarder:
    """Sends requests to nodes in the order a policy chose, failing over before the first byte."""

    def __init__(
        self,
        settings: RouterSettings,
        fleet: FleetState,
        metrics: RouterMetrics,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._settings = settings
        self._node_auth = f"Bearer {settings.cluster_token.get_secret_value()}"
        self._fleet = fleet
        self._metrics = metrics
        self._client = client or make_upstream_client(settings)

    async def aclose(self) -> None:
        await self._client.aclose()

    def note_failure(self, candidate: Candidate, reason: str) -> None:
        node = candidate.node.node_id
        ejected_s = self._fleet.record_failure(node)
        self._metrics.upstream_failures.labels(candidate.region.name, node, reason).inc()
        log.info("node %s ejected for %.1fs after a %s failure", node, ejected_s, reason)

    def finish(self, candidate: Candidate, elapsed_s: float) -> None:
        self._fleet.end(candidate.node.node_id)
        self._metrics.latency.labels(candidate.region.name).observe(elapsed_s)

    async def forward(
        self,
        route: str,
        request: InferenceRequest,
        candidates: Sequence[Candidate],
        request_id: str,
        received_at: float,
        exhausted: RouterError,
        queued_s: float = 0.0,
    ) -> Response:
        """Answer `request` from the first candidate that works; `exhausted` when none does.

        `received_at` is `time.perf_counter()` when the request body had been read;
        `queued_s` is how long it then waited for a replica (scale-from-zero), which is
        not router overhead.
        """
        s = self._settings
        deadline = asyncio.get_running_loop().time() + s.request_timeout_s
        upstream_wait = queued_s
        previous: Candidate | None = None
        for candidate in list(candidates)[: s.max_attempts]:
            if previous is not None:
                self._metrics.failovers.labels(previous.region.name, candidate.region.name).inc()
            previous = candidate
            node = candidate.node.node_id
            sent_at = time.perf_counter()
            overhead_s = max(0.0, sent_at - received_at - upstream_wait)
            self._fleet.begin(node)
            try:
                response = await self._attempt(
                    route, request, candidate, request_id, deadline, received_at
                )
            except _NodeFailed as exc:
                self._fleet.end(node)
                upstream_wait += time.perf_counter() - sent_at
                log.warning("request %s: node %s failed (%s); trying the next replica",
                            request_id, node, exc)
                self.note_failure(candidate, exc.reason)
                continue
            except TimeoutError:
                self._fleet.end(node)
                self.note_failure(candidate, "timeout")
                raise UpstreamTimeout(s.request_timeout_s) from None
            except httpx.PoolTimeout:
                # Our own pool is full: not the node's fault, and no other node would do better.
                self._fleet.end(node)
                raise RouterOverloaded() from None
            except BaseException:
                self._fleet.end(node)
                raise
            if not isinstance(response, _UpstreamStreamingResponse):
                self.finish(candidate, time.perf_counter() - received_at)
            response.headers[HEADER_REGION] = candidate.region.name
            response.headers[HEADER_NODE] = node
            response.headers[HEADER_REQUEST_ID] = request_id
            response.headers[HEADER_OVERHEAD_MS] = f"{overhead_s * 1000:.3f}"
            self._metrics.overhead.observe(overhead_s)
            self._metrics.requests.labels(
                candidate.region.name, node, str(response.status_code)
            ).inc()
            return response
        raise exhausted

    async def _attempt(
        self,
        route: str,
        request: InferenceRequest,
        candidate: Candidate,
        request_id: str,
        deadline: float,
        received_at: float,
    ) -> Response:
        """One try on one node: a Response to commit to, or _NodeFailed."""
        s = self._settings
        upstream = self._client.build_request(
            "POST",
            candidate.node.url + route,
            content=request.body,
            headers={
                "content-type": "application/json",
                "accept": "text/event-stream" if request.stream else "application/json",
                # Bytes are passed through untouched, so ask for them uncompressed.
                "accept-encoding": "identity",
                HEADER_REQUEST_ID: request_id,
                # Nodes serve routers only; the tenant's own key never leaves the router.
                "authorization": self._node_auth,
            },
            timeout=httpx.Timeout(
                connect=s.connect_timeout_s,
                # A non-streamed answer arrives only once generation is done.
                read=s.read_timeout_s if request.stream else s.request_timeout_s,
                write=s.read_timeout_s,
                pool=s.connect_timeout_s,
            ),
        )
        resp: httpx.Response | None = None
        committed = False
        try:
            async with asyncio.timeout_at(deadline):
                resp = await self._client.send(upstream, stream=True)
                if resp.status_code >= 500:
                    raise _NodeFailed("5xx", f"HTTP {resp.status_code}")
                headers = {k: v for k in _PASSTHROUGH_HEADERS if (v := resp.headers.get(k))}
                if not request.stream or resp.status_code >= 300:
                    body = await resp.aread()
                    # A 4xx is the client's fault: the node is healthy and it is not retried.
                    self._fleet.record_success(candidate.node.node_id)
                    return Response(body, status_code=resp.status_code, headers=headers)
                is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                framer = _SSEFramer(is_sse)
                chunks = resp.aiter_bytes()
                first, ended = b"", False
                while not first:
                    try:
                        first = framer.feed(await anext(chunks))
                    except StopAsyncIteration:
                        first, ended = framer.flush(), True
                        break
                committed = True
        except httpx.PoolTimeout:
            raise
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise _NodeFailed(_failure_reason(exc), f"{type(exc).__name__}: {exc}") from None
        finally:
            # A non-streamed answer has been read whole; a streamed one now belongs to the
            # response that passes it on.
            if not committed and resp is not None and not resp.is_closed:
                with anyio.CancelScope(shield=True):
                    await resp.aclose()
        assert resp is not None
        self._fleet.record_success(candidate.node.node_id)
        stream = _UpstreamStream(
            self, candidate, resp, chunks, framer, first, ended, deadline, received_at
        )
        headers.setdefault("cache-control", "no-cache")
        headers["x-accel-buffering"] = "no"  # proxies in front must not buffer the stream
        return _UpstreamStreamingResponse(stream, resp.status_code, headers)
