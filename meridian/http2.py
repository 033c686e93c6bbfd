"""HTTP/2 on a listener that serves HTTP/1.1 with uvicorn: the connections that speak it are
handed to hypercorn's HTTP/2 protocol, on the same port.

Why a hand-off and not another server: uvicorn speaks HTTP/1.1 only, and its listener
carries the fabric's limits (meridian.http_server) that every HTTP/1.1 client meets. A
connection speaks HTTP/2 either by prior knowledge (h2c: its first bytes are the HTTP/2
preface, as gRPC-style clients, Envoy and `curl --http2-prior-knowledge` send) or, over
TLS, by ALPN (`h2`, offered next to `http/1.1` by `alpn_config`). The listener's protocol
sees the preface or the ALPN choice before anything is parsed and hands the transport to
hypercorn's connection handler, which serves the same ASGI app. WebSocket mode stays
HTTP/1.1's upgrade: hypercorn advertises RFC 8441's extended CONNECT, but a WebSocket over
HTTP/2 is refused (403) since it would bypass the HTTP/1.1 socket's message size and pings;
the Responses WebSocket's clients (SDKs: browsers cannot set its Authorization header)
upgrade over HTTP/1.1. The h2c Upgrade header is not taken: clients that want h2c send the
preface.

Limits on an HTTP/2 connection:

- at most `max_streams` concurrent streams (SETTINGS_MAX_CONCURRENT_STREAMS), a header
  list of at most max_header_bytes once decompressed (HPACK bombs), the keep-alive idle
  timeout, and hypercorn's 1,000 requests per connection (then GOAWAY), which with the
  frame budget below bounds rapid reset; h2 refuses a header block of more than 64
  CONTINUATION frames;
- at most `max_control_frames_per_s` control frames a second (SETTINGS, PING, PRIORITY,
  RST_STREAM, WINDOW_UPDATE, GOAWAY, unknown types, and DATA frames that are empty and do
  not end their stream): past it the connection is sent GOAWAY with ENHANCE_YOUR_CALM and
  closed (the shapes of CVE-2019-9512, 9515, 9516 and 9518: each frame costs the server far
  more than the client). Counted by `FrameMeter` on the bytes as they arrive, before h2
  parses them: a walk over the 9-byte frame heads, nothing per byte of DATA. A
  WINDOW_UPDATE is free while the server has sent DATA frames it can answer (two per DATA
  frame: stream and connection), so a client downloading fast with small flow-control
  windows is never cut off;
- a request's body must arrive whole within `body_timeout_s` of its head, as on HTTP/1.1:
  408 in the listener's error format when no answer has started, else the stream is reset.
  Deadlines are checked by one sweep per listener (a deadline assignment per stream, no
  timer);
- a stream answered before its body ended (the 408, or an app's early 401 or 413) is reset
  with NO_ERROR once the answer is complete (RFC 9113, 8.1): it stops counting against the
  concurrent streams, and its further DATA is dropped by h2 rather than reaching hypercorn
  (which failed the whole connection on it);
- the connection counts towards the listener's max_connections while it lives (its place
  is held by a marker that uvicorn's shutdown asks to close, so a SIGTERM drains HTTP/2
  connections as it drains HTTP/1.1 ones).

The stream bookkeeping reaches into hypercorn's H2Protocol (its h2 connection and stream
table) and HTTPStream (the stream id behind the ASGI `send`): hypercorn is pinned below
the next minor version for that, and tests/e2e/test_http2_limits.py and
tests/unit/meridian/test_http2.py exercise both.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from typing import Any

import h2.exceptions
from h2.errors import ErrorCodes
from h2.stream import StreamState
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h2 import H2Protocol
from uvicorn.config import Config

from meridian.http_server import LINGER_S, ErrorBody

log = logging.getLogger(__name__)

ALPN = ["h2", "http/1.1"]

_PREFACE_BYTES = 24  # the client's connection preface, before its first frame
_HEAD_BYTES = 9  # a frame's head: length (3), type, flags, stream id (4)
_DATA, _HEADERS, _SETTINGS, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0x0, 0x1, 0x4, 0x7, 0x8, 0x9
_END_STREAM = 0x1
# What a server sends first (RFC 9113, 3.4): an empty SETTINGS frame, when a connection is
# cut off before hypercorn has sent its own.
_EMPTY_SETTINGS = bytes([0, 0, 0, _SETTINGS, 0, 0, 0, 0, 0])
_STILL_SENDING = (StreamState.OPEN, StreamState.HALF_CLOSED_LOCAL)
# Expired streams whose answer (the 408, or the reset) may go out per turn of the event loop.
# Streams opened together time out together, and each answer wakes its app to unwind (about
# half a millisecond here with hypercorn's frames): 500 in one turn held every other
# client's request for 200-350 ms (the attack suite's h2_endless_bodies on two cores).
EXPIRED_PER_TURN = 16
# How often pending body deadlines are swept, at most.
SWEEP_S = 0.1


class FrameMeter:
    """Counts the control frames a client sends on one HTTP/2 connection, in one-second
    windows, from the raw bytes (the preface first, then frames)."""

    __slots__ = ("_count", "_credit", "_limit", "_skip", "_tail", "_window_end", "last_stream_id", "sent_any")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._count = 0
        self._window_end = -math.inf
        # WINDOW_UPDATEs that DATA sent may be answered with, not counted (at most `limit`).
        self._credit = 0
        # Bytes of the current frame's payload (or of the preface) still to come.
        self._skip = _PREFACE_BYTES
        # The start of a frame head that the last read cut short.
        self._tail = b""
        # The highest stream a client's HEADERS opened, as GOAWAY's last stream id.
        self.last_stream_id = 0
        # Whether the server has written anything yet (its SETTINGS first).
        self.sent_any = False

    def feed(self, data: bytes, now: float) -> bool:
        """Account for `data` received at loop time `now`: False once the connection has
        sent more than `limit` control frames within a second."""
        if now >= self._window_end:
            self._window_end = now + 1.0
            self._count = 0
        buf = self._tail + data if self._tail else data
        n = len(buf)
        pos = self._skip
        count = 0
        top = self.last_stream_id
        while pos + _HEAD_BYTES <= n:
            length = buf[pos] << 16 | buf[pos + 1] << 8 | buf[pos + 2]
            kind = buf[pos + 3]
            if kind == _DATA:
                # An empty DATA frame that does not end its stream carries nothing (9518).
                count += length == 0 and not buf[pos + 4] & _END_STREAM
            elif kind == _HEADERS:
                top = max(top, int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF)
            elif kind == _WINDOW_UPDATE and self._credit:
                self._credit -= 1
            elif kind != _CONTINUATION:  # CONTINUATION floods are h2's to refuse
                count += 1
            pos += _HEAD_BYTES + length
        if pos > n:
            self._skip, self._tail = pos - n, b""
        else:
            self._skip, self._tail = 0, buf[pos:]
        self._count += count
        if self._count > self._limit:
            return False
        self.last_stream_id = top
        return True

    def sent(self, data: bytes | bytearray | memoryview) -> None:
        """The server wrote `data` (whole frames): a DATA frame may be answered with two
        WINDOW_UPDATEs (its stream's and the connection's)."""
        self.sent_any = True
        if len(data) > _HEAD_BYTES and data[3] == _DATA and self._credit < self._limit:
            self._credit += 2

    def goaway(self) -> bytes:
        """A GOAWAY frame with ENHANCE_YOUR_CALM and the last stream taken."""
        payload = self.last_stream_id.to_bytes(4, "big") + int(ErrorCodes.ENHANCE_YOUR_CALM).to_bytes(4, "big")
        return bytes([0, 0, len(payload), _GOAWAY, 0, 0, 0, 0, 0]) + payload


class _MeteredProtocol(asyncio.StreamReaderProtocol):
    """hypercorn's reading side of one HTTP/2 connection, behind a FrameMeter: over the
    budget, the connection is sent GOAWAY and closed, and nothing more is read."""

    def __init__(self, reader: asyncio.StreamReader, meter: FrameMeter, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, loop=loop)
        self._meter = meter
        self._loop = loop
        self._cut = False
        self._metered: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._metered = transport  # type: ignore[assignment] # uvloop's is no asyncio.Transport
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._cut:
            return
        if self._meter.feed(data, self._loop.time()):
            super().data_received(data)
            return
        self._cut = True
        transport = self._metered
        assert transport is not None
        transport.write((b"" if self._meter.sent_any else _EMPTY_SETTINGS) + self._meter.goaway())
        # A lingering close, as meridian.http_server's: closing with the client's bytes unread
        # would reset the connection, and the client could lose the GOAWAY. Its further bytes
        # are read and dropped until it closes, or for LINGER_S; a client that does not read
        # cannot hold the connection open with the GOAWAY unsent either.
        if transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()
        self._loop.call_later(LINGER_S, transport.abort)


class _MeteredWriter(asyncio.StreamWriter):
    """hypercorn's writing side: tells the meter what the server sends."""

    def __init__(self, transport: asyncio.Transport, protocol: _MeteredProtocol, reader: asyncio.StreamReader,
                 loop: asyncio.AbstractEventLoop, meter: FrameMeter) -> None:
        super().__init__(transport, protocol, reader, loop)
        self._meter = meter

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._meter.sent(data)
        super().write(data)


class H2Handoff:
    """Serves the HTTP/2 connections of one listener with hypercorn's protocol."""

    def __init__(self, app: Any, *, max_streams: int, max_header_bytes: int, keep_alive_s: float,
                 max_control_frames_per_s: int, body_timeout_s: float, error_body: ErrorBody) -> None:
        config = HypercornConfig()
        config.h2_max_concurrent_streams = max_streams
        config.h2_max_header_list_size = max_header_bytes
        config.keep_alive_timeout = keep_alive_s
        config.include_server_header = False
        config.accesslog = None
        config.errorlog = logging.getLogger("meridian.http2")
        self._config = config
        self._app = app
        self._max_control_frames_per_s = max_control_frames_per_s
        self.body_timeout_s = body_timeout_s
        self.error_body = error_body
        self._context = WorkerContext(None)
        self._state: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Swept often (a sweep with nothing due reads one entry): streams opened over a few
        # tenths of a second then expire over as many sweeps, not all in one.
        self._deadlines = _BodyDeadlines(min(SWEEP_S, body_timeout_s / 4))
        self.expiries = PerTurn(EXPIRED_PER_TURN)

    def take(self, transport: asyncio.Transport, first: bytes, connections: set[Any]) -> None:
        """Serve the connection on `transport` over HTTP/2 from now on; `first`: what was
        read of it already. It holds a place in `connections` until it ends."""
        loop = asyncio.get_running_loop()
        meter = FrameMeter(self._max_control_frames_per_s)
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        protocol = _MeteredProtocol(reader, meter, loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        writer = _MeteredWriter(transport, protocol, reader, loop, meter)
        if first:
            protocol.data_received(first)
        if not transport.is_reading() and not transport.is_closing():
            transport.resume_reading()
        marker = _Held(self)
        connections.add(marker)
        streams = _Streams(self, self._app)
        server = TCPServer(streams, loop, self._config, self._context, self._state, reader, writer)
        streams.server = server
        task = loop.create_task(self._serve(server, marker, connections), name="http2-connection")
        self.spawned(task)

    def spawned(self, task: asyncio.Task[None]) -> None:
        """Hold `task` until it ends (the loop keeps only weak references)."""
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("HTTP/2 %s failed", task.get_name(), exc_info=task.exception())

    def guard(self, stream: _StreamGuard) -> None:
        self._deadlines.add(stream)

    def unguard(self, stream: _StreamGuard) -> None:
        self._deadlines.discard(stream)

    async def _serve(self, server: TCPServer, marker: _Held, connections: set[Any]) -> None:
        try:
            await server.run()
        except Exception:  # noqa: BLE001 - one connection's failure must not reach the loop
            log.exception("HTTP/2 connection failed")
        finally:
            connections.discard(marker)

    def drain(self) -> None:
        """Stop taking new streams: connections close once their streams end (GOAWAY)."""
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._context.terminated.set())


class _Streams:
    """The app as hypercorn calls it on one connection (its AppWrapper): each HTTP
    stream's app runs behind a _StreamGuard."""

    def __init__(self, handoff: H2Handoff, app: Any) -> None:
        self.handoff = handoff
        self._app = app
        self.server: TCPServer | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> None:
        # hypercorn's `send` for an HTTP stream is its HTTPStream's method: the stream's id.
        stream_id = getattr(getattr(send, "__self__", None), "stream_id", None)
        if scope["type"] == "websocket":
            # RFC 8441's WebSocket over HTTP/2, which hypercorn offers, would bypass the HTTP/1.1
            # socket's limits (its message size, its pings), and its flow control stalls a
            # message past 128 KiB. Refused before it is accepted (hypercorn answers 403).
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http" or stream_id is None:
            await self._app(scope, receive, send)
            return
        guard = _StreamGuard(self, stream_id, send)
        try:
            await self._app(scope, receive, guard.send)
        finally:
            self.handoff.unguard(guard)

    def protocol(self) -> H2Protocol | None:
        """hypercorn's protocol of this connection while it serves HTTP/2."""
        wrapper = getattr(self.server, "protocol", None)
        protocol = getattr(wrapper, "protocol", None)
        return protocol if isinstance(protocol, H2Protocol) and not protocol.closed else None

    def still_sending(self, stream_id: int) -> bool:
        """Whether the client has yet to end the request on `stream_id` (its body)."""
        protocol = self.protocol()
        stream = protocol.connection.streams.get(stream_id) if protocol is not None else None
        return stream is not None and stream.state_machine.state in _STILL_SENDING

    async def reset(self, stream_id: int, code: ErrorCodes) -> None:
        """Reset the stream (RST_STREAM with `code`) and let hypercorn forget it: its app
        sees a disconnect, and what it still sends is dropped."""
        protocol = self.protocol()
        if protocol is None:
            return
        try:
            protocol.connection.reset_stream(stream_id, code)
        except h2.exceptions.ProtocolError:
            return  # closed meanwhile
        await protocol._flush()
        await protocol._close_stream(stream_id)
        await protocol._window_updated(stream_id)


class _StreamGuard:
    """One HTTP stream's body deadline, and the app's `send` as the stream sees it: nothing
    the app sends passes once the listener has answered or reset the stream."""

    __slots__ = ("_conn", "_send", "answered", "deadline", "started", "stream_id")

    def __init__(self, conn: _Streams, stream_id: int, send: Any) -> None:
        self._conn = conn
        self._send = send
        self.stream_id = stream_id
        self.started = False
        self.answered = False
        self.deadline = asyncio.get_running_loop().time() + conn.handoff.body_timeout_s
        conn.handoff.guard(self)

    async def send(self, message: Any) -> None:
        if self.answered:
            return
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
        await self._send(message)
        if kind == "http.response.body" and not message.get("more_body", False):
            self._conn.handoff.unguard(self)
            await self._end_request()

    async def _end_request(self) -> None:
        """After a complete answer: a request still being sent is reset with NO_ERROR."""
        if self._conn.still_sending(self.stream_id):
            await self._conn.reset(self.stream_id, ErrorCodes.NO_ERROR)

    def expired(self) -> None:
        """The body deadline passed (called by the sweep)."""
        if self.answered or not self._conn.still_sending(self.stream_id):
            return  # the body came whole: the app's answer takes the time it takes
        self.answered = True
        task = asyncio.get_running_loop().create_task(
            self._reset_late() if self.started else self._answer_timeout(), name="http2-body-timeout")
        self._conn.handoff.spawned(task)

    async def _answer_timeout(self) -> None:
        handoff = self._conn.handoff
        await handoff.expiries.take()
        content_type, body = handoff.error_body(
            408, f"The request body did not arrive within {handoff.body_timeout_s:g} seconds.")
        await self._send({"type": "http.response.start", "status": 408, "headers": [
            (b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body})
        await self._end_request()

    async def _reset_late(self) -> None:
        await self._conn.handoff.expiries.take()
        await self._conn.reset(self.stream_id, ErrorCodes.CANCEL)


class PerTurn:
    """At most `n` callers pass `take()` per turn of the event loop; the rest wait, in order,
    for later turns, so that sockets already readable are served between the batches."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._passed = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._armed = False

    async def take(self) -> None:
        if self._passed < self._n and not self._waiting:
            self._passed += 1
            self._arm()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._arm()
        await waiter

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        """A new turn: up to `n` of the waiting pass (they run on the turn after this one)."""
        self._armed = False
        self._passed = 0
        while self._waiting and self._passed < self._n:
            waiter = self._waiting.popleft()
            if not waiter.done():  # a waiter cancelled meanwhile takes no place
                waiter.set_result(None)
                self._passed += 1
        if self._waiting or self._passed:
            self._arm()


class _BodyDeadlines:
    """The body deadlines of one listener's HTTP/2 streams, swept every `period` while any
    is pending. Streams come in deadline order (one timeout for all), so a sweep reads
    from the oldest and stops at the first one not due."""

    def __init__(self, period: float) -> None:
        self._period = period
        self._pending: dict[_StreamGuard, None] = {}
        self._sweeping = False

    def add(self, stream: _StreamGuard) -> None:
        self._pending[stream] = None
        if not self._sweeping:
            self._sweeping = True
            asyncio.get_running_loop().call_later(self._period, self._sweep)

    def discard(self, stream: _StreamGuard) -> None:
        self._pending.pop(stream, None)

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        due: list[_StreamGuard] = []
        for stream in self._pending:
            if stream.deadline > now:
                break
            due.append(stream)
        for stream in due:
            del self._pending[stream]
            try:
                stream.expired()
            except Exception:  # noqa: BLE001 - one stream's failure must not stop the sweep
                log.exception("HTTP/2 body deadline failed")
        if self._pending:
            loop.call_later(self._period, self._sweep)
        else:
            self._sweeping = False


class _Held:
    """An HTTP/2 connection's place among the listener's connections (uvicorn counts them
    and asks each to shut down on SIGTERM)."""

    def __init__(self, handoff: H2Handoff) -> None:
        self._handoff = handoff

    def shutdown(self) -> None:
        self._handoff.drain()


class AlpnConfig(Config):
    """uvicorn's Config whose TLS context offers h2 next to http/1.1 (ALPN)."""

    def load(self) -> None:
        super().load()
        if self.ssl is not None:
            self.ssl.set_alpn_protocols(ALPN)
