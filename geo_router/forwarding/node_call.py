"""One HTTP/1.1 exchange with a node, as every part of the router makes it.

The forwarder's attempts (geo_router.forwarding.forwarder) and a migrating stream's calls (its
continuations and /detokenize, geo_router.forwarding.migration) reach nodes the same way: a request
head with the cluster token (the tenant's own key never leaves the router) and the
request's trace context; one of a bounded number of upstream slots (each exchange holds
at most one connection, so the slots bound the pool, and a router whose own pool is full
says so instead of blaming a node); a pooled connection, sent again once on a new one
when the pooled one was closed by the node before it read a byte (its keep-alive
timeout: the node never saw the request, so it cannot run twice); and, for a stream, its
first whole SSE event read before anything is committed to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meridian.contracts import HEADER_REQUEST_ID
from meridian.settings.router import RouterSettings

from ..errors import RouterOverloaded
from ..ingress.request import InferenceRequest
from ..sse import SSEFramer
from .upstream import FailureReason, Origin, UpstreamConnection, UpstreamError, UpstreamPool


class NodeCaller:
    """The pooled client, the slots that bound it, and the exchange steps built on them."""

    def __init__(self, settings: RouterSettings, client: UpstreamPool) -> None:
        self.client = client
        self.read_timeout_s = settings.read_timeout_s
        self._connect_timeout_s = settings.connect_timeout_s
        self._node_auth = f"Bearer {settings.cluster_token.get_secret_value()}"
        # Upstream exchanges in flight: at most one connection each, so this bounds the pool.
        self._slots = asyncio.Semaphore(settings.max_upstream_connections)

    def release(self, conn: UpstreamConnection | None) -> None:
        """An exchange is over: its connection (if it got one) back to the pool, its slot freed."""
        if conn is not None:
            self.client.release(conn)
        self._slots.release()

    async def take_slot(self) -> None:
        if not self._slots.locked():
            await self._slots.acquire()  # free: returns without suspending
            return
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            # Our own pool is full: not the node's fault, and no other node would do better.
            raise RouterOverloaded() from None

    async def exchange(self, origin: Origin, head: bytes, body: bytes, stream: bool,
                        status_timeout_s: float | None = None,
                        on_send: Callable[[], None] | None = None) -> UpstreamConnection:
        """Send the request and wait for the answer's status line on a pooled connection (a
        stream's within `status_timeout_s`, the read timeout by default); `on_send` is
        called as the request goes out (before that, nothing of it can have run)."""
        status_timeout_s = status_timeout_s or self.read_timeout_s
        conn, reused = await self.client.acquire(origin)
        for retry in (True, False):
            if on_send is not None:
                on_send()
            conn.send(head, body)
            try:
                if stream:
                    # A stream must start within the read timeout, like each of its chunks.
                    async with asyncio.timeout(status_timeout_s):
                        await conn.status()
                else:
                    await conn.status()  # a whole generation: bounded by the request deadline
                return conn
            except TimeoutError:  # the read timeout (the deadline's expiry arrives as a cancel)
                self.client.release(conn)
                raise UpstreamError(FailureReason.TIMEOUT, f"no answer within {status_timeout_s:g}s") from None
            except UpstreamError:
                self.client.release(conn)
                # A pooled connection the node closed as the request went out (its keep-alive
                # timeout): nothing came back, so the node never took the request and sending
                # it again on a new connection cannot run it twice. nginx does the same.
                if not (retry and reused and not conn.got_bytes):
                    raise
            except BaseException:
                self.client.release(conn)  # mid-exchange: closed, never pooled
                raise
            conn, reused = await self.client.connect(origin), False
        raise AssertionError("unreachable")

    async def whole(self, url: str, method: str, route: str, body: bytes, deadline: float, *,
                    request_id: str = "", trace_headers: str = "") -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One exchange answered whole (status, headers, body) by the loop time `deadline`:
        the router's own small calls to a node (a prefill hop, /detokenize, a KV release).
        Raises ValueError for a bad node URL, RouterOverloaded, UpstreamError or TimeoutError."""
        origin = self.client.origin(url)
        head = self.request_head(method, origin, route, InferenceRequest(body, "", False, {}), request_id,
                                 trace_headers)
        await self.take_slot()
        conn: UpstreamConnection | None = None
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self.exchange(origin, head, body, False)
                status, headers = await conn.status()
                return status, headers, await conn.read_all()
        finally:
            self.release(conn)

    def request_head(
        self, method: str, origin: Origin, route: str, request: InferenceRequest, request_id: str,
        trace_headers: str = "",
    ) -> bytes:
        """The HTTP/1.1 request line and headers sent to the node (`trace_headers`: whole
        `name: value\r\n` lines of the request's trace context, from the propagators)."""
        return (
            f"{method} {origin.base_path}{route} HTTP/1.1\r\n"
            f"host: {origin.authority}\r\n"
            "content-type: application/json\r\n"
            f"accept: {'text/event-stream' if request.stream else 'application/json'}\r\n"
            # Bytes are passed through untouched, so ask for them uncompressed.
            "accept-encoding: identity\r\n"
            # request_id is a sanitised token (request_id_for): no header injection.
            + (f"{HEADER_REQUEST_ID}: {request_id}\r\n" if request_id else "") +
            # Nodes serve routers only; the tenant's own key never leaves the router.
            f"authorization: {self._node_auth}\r\n"
            f"{trace_headers}"
            f"content-length: {len(request.body)}\r\n\r\n"
        ).encode("latin-1")

    async def first_event(self, conn: UpstreamConnection, framer: SSEFramer,
                           timeout_s: float | None = None) -> tuple[bytes, bool]:
        """A stream's first complete event (whatever the node sent, if it ended before one),
        and whether the stream has ended; each read within `timeout_s` (the read timeout)."""
        timeout_s = timeout_s or self.read_timeout_s
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    chunk = await conn.read_chunk()
            except TimeoutError:  # the read timeout (the deadline's expiry arrives as a cancel)
                raise UpstreamError(FailureReason.TIMEOUT, f"no event within {timeout_s:g}s") from None
            if not chunk:
                return framer.flush(), True
            first = framer.feed(chunk)
            if first:
                return first, False
