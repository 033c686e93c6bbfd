"""The upstream HTTP/1.1 client: how the router reaches a node, and how that can fail.

`UpstreamPool` is a keep-alive HTTP/1.1 client made for this one job (a POST with a small
body, an answer passed on as it arrives) on asyncio protocols and httptools, the parser
uvicorn uses. CPU per request of the client alone on one pooled connection (uvloop, 2-vCPU
box): httpx ≈ 1000 µs, aiohttp ≈ 220 µs, this one ≈ 45 µs; of the whole router under load
(bench/router.py set-up): httpx 2600 µs and 270 req/s at most (httpcore's pool scans every
connection for every request, httpx issue #3215), aiohttp 670 µs and 1260 req/s, this one
440 µs and 1740 req/s. It never reads proxy settings from the environment, never follows
redirects and keeps no cookies: node traffic is cluster-internal, and one client serves
every tenant.

Every failure to talk to a node is an `UpstreamError` with a `FailureReason`; the same
reasons (and two the forwarder adds) label `meridian_router_upstream_failures`.
Failover and answering the client are geo_router.forwarding.forwarder's.
"""

from __future__ import annotations

import asyncio
import math
import ssl
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import cast
from urllib.parse import urlsplit

import httptools

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.http_server import CLIENT_KEEPALIVE_S
from meridian.settings.router import RouterSettings

# A streamed answer buffered beyond this stops being read from the node until the client
# catches up (TCP then slows the node down): backpressure, and bounded memory per stream.
_HIGH_WATER = 256 * 1024
# Bodies up to this size are joined to the head and written with one syscall.
_JOIN_BODY_BELOW = 64 * 1024


class FailureReason(StrEnum):
    """Why an attempt on a node failed (the `reason` label of the upstream-failure metric)."""

    CONNECT = "connect"  # nothing listening: refused, unreachable, connect timeout
    CLOSED = "closed"  # the connection closed before any answer (the node is gone)
    TIMEOUT = "timeout"  # no answer, or no event of a stream, within the read timeout
    PROTOCOL = "protocol"  # invalid HTTP, a bad node URL, a close in mid-answer
    SERVER_ERROR = "5xx"  # the node answered 5xx
    MIDSTREAM = "midstream"  # a committed stream broke

    @property
    def node_gone(self) -> bool:
        """The node never took the request or vanished before answering."""
        return self in (FailureReason.CONNECT, FailureReason.CLOSED)


class UpstreamError(Exception):
    """Talking to a node failed; `reason` is CONNECT, CLOSED (before any answer), TIMEOUT
    or PROTOCOL."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a node listens, parsed once per URL."""

    scheme: str
    host: str
    port: int
    authority: str  # the Host header
    base_path: str  # a path prefix in the node's URL ("" for none)

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.netloc.rpartition("@")[2],
                   parts.path.rstrip("/"))


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a node, carrying one exchange at a time."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.idle_since = 0.0
        self.closed = False
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._busy = False
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[None] | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._body_waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._until_close = False
        self._error: UpstreamError | None = None
        self._paused = False
        self.got_bytes = False
        # A stream's read timeout (read_chunk_by): the loop time the waiting read ends by, and
        # one timer that checks it, moved only when it would fire too late.
        self._read_by = math.inf
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = math.inf

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy or self._complete:
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(FailureReason.PROTOCOL, f"invalid HTTP from the node: {exc}"))
            self.close()

    def eof_received(self) -> None:
        # The node closed its side: not reusable from now on, not one loop turn later when
        # connection_lost runs (returning None lets the transport close itself).
        self.closed = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._busy or self._complete:
            return
        if exc is None and self._until_close and self._head is not None and self._head.done():
            self._finish()  # a body delimited by the end of the connection
            return
        detail = f"connection closed by the node ({exc})" if exc else "connection closed by the node"
        # Before the status line the node is gone (crashed, killed), not misbehaving.
        reason = (
            FailureReason.PROTOCOL if self._head is not None and self._head.done() else FailureReason.CLOSED
        )
        self._fail(UpstreamError(reason, detail))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 1xx: an interim answer; the real one follows
            self._headers = []
            return
        self._status = status
        lengths = [v for k, v in self._headers if k in (b"content-length", b"transfer-encoding")]
        self._until_close = not lengths and status not in (204, 304)
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._status == 0:
            return  # the end of a 1xx
        if not self._parser.should_keep_alive():
            self.closed = True  # pooled no more; closed once the body has been taken
        self._finish()

    # one exchange

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # seen: whoever awaits it still gets it, nobody else logs it
        self._wake()

    def _wake(self) -> None:
        waiter, self._body_waiter = self._body_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def send(self, head: bytes, body: bytes) -> None:
        """Start an exchange: write the request; `status()` waits for the answer."""
        assert self._transport is not None and not self._busy
        self._busy = True
        self._status = 0
        self._headers = []
        self._complete = self._until_close = self.got_bytes = False
        self._error = None
        self._body.clear()
        self._buffered = 0
        self._head = asyncio.get_running_loop().create_future()
        if len(body) < _JOIN_BODY_BELOW:
            self._transport.write(head + body)
        else:
            self._transport.writelines((head, body))

    async def status(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The answer's status and headers (names lower-cased)."""
        assert self._head is not None
        if not self._head.done():
            await self._head
        self._head.result()
        return self._status, self._headers

    async def read_chunk(self) -> bytes:
        """The body bytes received so far (waiting for some); b"" at its end."""
        self._read_by = math.inf
        return await self._read()

    async def read_chunk_by(self, deadline: float) -> bytes:
        """read_chunk, or TimeoutError when nothing came by the loop time `deadline`.

        A stream reads each chunk (a token, from a real node) with a timeout. Made with
        asyncio.timeout_at, that is a timer made and cancelled per chunk: 3.5 µs, more than a
        token's whole relay. Here the connection keeps one timer: a read moves it only when it
        would fire later than the read's deadline, and when it fires it ends the waiting read
        if that read's deadline has passed, else waits on until it has.
        """
        self._read_by = deadline
        if deadline < self._watchdog_at and not (self._body or self._complete or self._error is not None):
            self._arm(deadline)
        return await self._read()

    def _arm(self, at: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = asyncio.get_running_loop().call_at(at, self._watchdog_fired)
        self._watchdog_at = at

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog, self._watchdog_at = None, math.inf

    def _watchdog_fired(self) -> None:
        self._watchdog, self._watchdog_at = None, math.inf
        waiter = self._body_waiter
        if waiter is None or waiter.done() or self._read_by == math.inf:
            return  # no timed read waits (a plain read has no deadline): the next timed read arms it
        if asyncio.get_running_loop().time() < self._read_by:
            self._arm(self._read_by)  # a later read moved its deadline on
            return
        self._body_waiter = None
        waiter.set_exception(TimeoutError())

    async def _read(self) -> bytes:
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._body_waiter = asyncio.get_running_loop().create_future()
            await self._body_waiter
        chunk = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    async def read_all(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def reusable(self) -> bool:
        """The exchange ended cleanly and the node keeps the connection open."""
        return self._complete and self._error is None and not self.closed and not self._body

    def end_exchange(self) -> None:
        self._busy = False
        self._disarm()

    def close(self) -> None:
        self.closed = True
        self._disarm()
        if self._transport is not None:
            self._transport.close()


class UpstreamPool:
    """Keep-alive connections to every node, reused most-recent-first.

    The number of connections is bounded by the caller (UpstreamForwarder's slots), so
    the pool itself only keeps idle ones, per origin, and drops those gone stale.
    """

    def __init__(
        self, connect_timeout_s: float, keepalive_s: float = CLIENT_KEEPALIVE_S, *, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._clock = clock
        self._keepalive_s = keepalive_s
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._origins: dict[str, Origin] = {}
        self._ssl: ssl.SSLContext | None = None

    def origin(self, url: str) -> Origin:
        """The parsed origin of a node URL (cached: node URLs are few)."""
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) > 10_000:
                self._origins.clear()
            origin = self._origins[url] = Origin.parse(url)
        return origin

    async def acquire(self, origin: Origin) -> tuple[UpstreamConnection, bool]:
        """A connection to `origin` and whether it is a reused one."""
        idle = self._idle.get(origin)
        if idle:
            now = self._clock.monotonic()
            while idle:
                conn = idle.pop()
                if not conn.closed and now - conn.idle_since < self._keepalive_s:
                    return conn, True
                conn.close()
        return await self.connect(origin), False

    async def connect(self, origin: Origin) -> UpstreamConnection:
        """A new connection to `origin` (UpstreamError CONNECT when there is none)."""
        loop = asyncio.get_running_loop()
        conn = UpstreamConnection(origin)
        tls: ssl.SSLContext | None = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await loop.create_connection(
                    lambda: conn, origin.host, origin.port, ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            raise UpstreamError(FailureReason.CONNECT, f"connect timeout after {self._connect_timeout_s:g}s") from None
        except OSError as exc:  # refused, unreachable, DNS, TLS
            raise UpstreamError(FailureReason.CONNECT, f"{type(exc).__name__}: {exc}") from None
        # asyncio and uvloop both set TCP_NODELAY on TCP transports: small writes go at once.
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Give a connection back after an exchange: pooled if reusable, else closed."""
        conn.end_exchange()
        if not conn.reusable():
            conn.close()
            return
        now = self._clock.monotonic()
        conn.idle_since = now
        idle = self._idle.setdefault(conn.origin, [])
        # The oldest sit at the bottom: drop the stale ones as the stack is touched.
        while idle and (idle[0].closed or now - idle[0].idle_since >= self._keepalive_s):
            idle.pop(0).close()
        idle.append(conn)

    async def aclose(self) -> None:
        """Close every idle connection (those in use are closed by their exchanges)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def make_upstream_client(settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> UpstreamPool:
    """The one pooled client the router uses to reach every node."""
    return UpstreamPool(settings.connect_timeout_s, clock=clock)
