"""Limits on every HTTP listener (router, node, control plane): what uvicorn leaves open.

uvicorn's httptools protocol has no limit on the size of a request's head and no timeout
for reading it or the body: 500 sockets sending partial headers stayed open past 80 s, and
20 unterminated 10 MB headers grew a router from 99 to 309 MiB (httptools buffers a
header until it ends). `LimitedHttpToolsProtocol` adds, per connection:

- `max_header_bytes`: a request head (request line and headers) larger than this is
  answered 431 and the connection closed; at most this plus one read is ever buffered;
- `header_timeout_s`: the head must arrive whole within this long of its first byte (or of
  the connection's opening): 408 and close otherwise. Slowloris' one byte every few
  seconds does not reset it, since it bounds the whole head, not the gap between reads;
- `body_timeout_s`: the body must arrive whole within this long of the head: 408 (when
  no answer has started) and close. The app sees a disconnect;
- `max_connections`: beyond this many open connections a new one is answered 503 with
  `Retry-After` at once and closed, before anything of it is read;
- `max_connections_per_client` (when set): the same for one client address. The count is
  of live transports, whatever protocol now serves them (a WebSocket upgrade or an HTTP/2
  hand-off replaces this protocol, not the connection);
- `max_pipelined_requests`: HTTP/1.1 pipelining. uvicorn parses every request in what it
  reads and queues the ones behind the running request without bound, and resumes reading
  after each answer and on each `receive()`: one keyless connection sending pipelined
  `GET /health` grew a router by 430 MiB in 11 s and starved every other client. Here,
  what is read is parsed only as far as the queue has room (a burst of a thousand
  requests in one read is parsed this many at a time), and with this many queued reading
  stops (nginx's way: the kernel's buffers and TCP push back) until one is answered. A
  client that pipelines is served in order, however many it sends; what it costs the
  server is this many queued requests and one read held back. Past 1 MiB held back (which
  takes reading resumed against the limit) the connection is closed.

uvicorn's access line of a request that carries an `x-request-id` (a node's, from the
router that sent it) has it as the record's `request_id` field, so that the router's line
(geo_router.observability.access_log) and the node's join on it.

It also tells the app when a client hangs up, without the app having to wait on
`receive()` in a task of its own for every request: the ASGI scope's
`extensions[DISCONNECT_EXTENSION]` registers a callback, called (once, on the loop) if the
connection is lost before that request's answer is complete.

Idle connections: a listener keeps one open for `SERVER_KEEPALIVE_S`, our pooled clients
reuse one for at most `CLIENT_KEEPALIVE_S`, so the client always lets go first. With both
at 5 s (uvicorn's and httpx's defaults, and vLLM's), a request sent on a connection idle
for just under 5 s can cross the server's close and fail with nothing read (ReadError);
that happened 1 time in 30 at that gap here, and once in CI between a node and its vLLM.

Concurrency of requests is capped where the work is (the router's upstream slots and
scale-from-zero queue, the node's waiting queue), each answering 503 with Retry-After.
The error bodies are the listener's own format (OpenAI error JSON on the inference API,
problem+json on the admin API), given as `error_body`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from meridian.contracts import HEADER_REQUEST_ID, REQUEST_ID_PATTERN
from meridian.settings import ListenerSettings

if TYPE_CHECKING:
    from meridian.http2 import H2Handoff

# scope["extensions"][DISCONNECT_EXTENSION](callback): call `callback()` if the client goes
# away before this request's answer is complete.
DISCONNECT_EXTENSION = "meridian.on_disconnect"

_REQUEST_ID_HEADER = HEADER_REQUEST_ID.encode()
_SANE_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)

# The first bytes of an HTTP/2 connection by prior knowledge (RFC 9113, 3.4).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Bytes held back past a full pipeline queue beyond which the connection is closed: more
# than one read (asyncio reads at most 256 KiB) means something resumed reading anyway.
_MAX_HELD_BYTES = 1 << 20

# How long a refused connection's further bytes are read and dropped before it is closed
# (nginx's lingering_timeout). Past it the close resets the connection, and a client that had
# not read yet loses what it was sent: a CI run's flooding client, stalled over 2 s on a
# loaded box, got neither SETTINGS nor GOAWAY back.
LINGER_S = 5.0

# How long a listener keeps an idle connection: longer than any client of ours keeps one
# pooled (CLIENT_KEEPALIVE_S) and than the load balancers that usually sit in front of
# the router (60 s on AWS ALB and GCP), so that the client, not the server, closes an idle
# connection: the other way round, a request sent as the server closes fails unread.
SERVER_KEEPALIVE_S = 75
# The longest our own pooled clients (the router's upstream pool, a node's client to
# vLLM, probes) reuse an idle connection: well inside SERVER_KEEPALIVE_S.
CLIENT_KEEPALIVE_S = 30.0

# (content type, body) of an error answered by the listener itself.
ErrorBody = Callable[[int, str], tuple[str, bytes]]


def openai_error_body(status: int, message: str) -> tuple[str, bytes]:
    """The inference API's error shape (router and nodes)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    codes = {408: "request_timeout", 431: "request_header_fields_too_large", 503: "too_many_connections"}
    body = {"error": {"message": message, "type": kind, "param": None, "code": codes.get(status)}}
    return "application/json", json.dumps(body).encode()


def problem_body(status: int, message: str) -> tuple[str, bytes]:
    """The admin API's error shape (RFC 9457 problem+json)."""
    titles = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}
    body = {"type": "about:blank", "title": titles.get(status, "Error"), "status": status, "detail": message}
    return "application/problem+json", json.dumps(body).encode()


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_header_bytes: int = 32 * 1024
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    # Seconds a client told "too many connections" should wait.
    retry_after_s: int = 1
    max_connections_per_client: int = 0
    max_pipelined_requests: int = 8

    @classmethod
    def of(cls, settings: ListenerSettings) -> ListenerLimits:
        return cls(settings.max_header_bytes, settings.header_timeout_s, settings.body_timeout_s,
                   settings.max_connections, max_connections_per_client=settings.max_connections_per_client,
                   max_pipelined_requests=settings.max_pipelined_requests)


class _PipelineFlow(FlowControl):
    """uvicorn's read flow control, except that reading stays paused while the connection
    has max_pipelined_requests queued: uvicorn resumes it after every answer and on every
    `receive()`, which is what let one connection queue requests without bound."""

    def __init__(self, transport: asyncio.Transport, pipeline: deque[Any], limit: int) -> None:
        super().__init__(transport)
        self._pipeline = pipeline
        self._limit = limit

    def resume_reading(self) -> None:
        if len(self._pipeline) < self._limit:
            super().resume_reading()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head size, head and body timeouts and a connection cap."""

    limits: ClassVar[ListenerLimits] = ListenerLimits()
    error_body: ClassVar[ErrorBody] = staticmethod(openai_error_body)
    # Where connections that speak HTTP/2 go (None: HTTP/1.1 only).
    h2: ClassVar[H2Handoff | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        # Reading a request's head: from the connection's opening, or the end of the previous
        # request's body, to the end of the head. Its clock runs from the opening or from the
        # head's first byte (a kept-alive connection's idle time is uvicorn's keep-alive).
        self._in_head = True
        self._head_clock = False
        self._in_body = False
        # After a refusal: the rest of what the client sends is read and dropped for a moment
        # (nginx's lingering close), so that its kernel does not reset the connection before
        # the client has read the answer.
        self._lingering = False
        # A head found over the limit once parsed whole (it fitted in one read): the parser's
        # remaining callbacks are ignored and the request is refused.
        self._oversized = False
        # Disconnect callbacks of each request whose answer is not complete, oldest first.
        self._on_disconnect: deque[list[Callable[[], None]]] = deque()
        # When the head or body being read must be whole (loop time; inf: nothing due).
        self._deadline = math.inf
        # Bytes read past a full pipeline queue, parsed once an answer makes room.
        self._held = b""
        # The connection's first bytes, held until they say whether it speaks HTTP/2.
        self._sniffing = self.h2 is not None
        self._sniffed = b""

    # --- connection -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _PipelineFlow(transport, self.pipeline, self.limits.max_pipelined_requests)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"The server has too many open connections ({self.limits.max_connections}). "
                              "Retry later.", retry_after=True)
            return
        if self.limits.max_connections_per_client and not _PerClient.admit(self, transport):
            self._refuse(503, "Too many open connections from your address "
                              f"({self.limits.max_connections_per_client}). Retry later.", retry_after=True)
            return
        self._head_clock = True
        self._arm(self.limits.header_timeout_s)
        ssl_object = transport.get_extra_info("ssl_object")
        if self.h2 is not None and ssl_object is not None and ssl_object.selected_alpn_protocol() == "h2":
            self._hand_to_h2(b"")

    def _hand_to_h2(self, first: bytes) -> None:
        """From now on hypercorn's HTTP/2 protocol serves this connection."""
        assert self.h2 is not None
        self._disarm()
        self._sniffing = False
        self.connections.discard(self)
        self.h2.take(self.transport, first, self.connections)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        self.pipeline.clear()  # queued requests that will never run: free them now
        callbacks = [cb for pending in self._on_disconnect for cb in pending]
        self._on_disconnect.clear()
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one app's callback must not break the others
                logging.getLogger(__name__).exception("disconnect callback failed")

    def on_response_complete(self) -> None:
        if self._on_disconnect:
            self._on_disconnect.popleft()  # answers complete in the order requests came
        super().on_response_complete()
        if self._held:
            # Not from here: this runs inside the app's send(), and parsing may start
            # the next request or answer an error.
            self.loop.call_soon(self._release_held)

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.transport.is_closing():
            return
        if self._sniffing:
            self._sniffed += data
            h2 = _speaks_h2(self._sniffed)
            if h2 is None:
                return  # part of the preface: wait for the rest
            if h2:
                self._hand_to_h2(self._sniffed)
                return
            self._sniffing = False
            data, self._sniffed = self._sniffed, b""
        self._feed(self._held + data if self._held else data)

    def _feed(self, data: bytes) -> None:
        """Parse `data` a few requests at a time: no further than the queue has room for
        (max_pipelined_requests); what is left is held, with reading paused, until an
        answer makes room."""
        self._held = b""
        while data:
            room = self.limits.max_pipelined_requests - len(self.pipeline)
            if room <= 0:
                self._held = data
                self.flow.pause_reading()
                if len(data) > _MAX_HELD_BYTES:  # reading was resumed past the queue's limit
                    self._overflow()
                return
            cut = _after_heads(data, room)
            self._parse(data[:cut])
            data = data[cut:]
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # refused, closed, or upgraded to a WebSocket

    def _parse(self, data: bytes) -> None:
        if self._in_head:
            if not self._head_clock:
                self._head_clock = True
                self._arm(self.limits.header_timeout_s)
            self._head_bytes += len(data)
        super().data_received(data)
        too_big = self._in_head and self._head_bytes > self.limits.max_header_bytes
        if (too_big or self._oversized) and not self.transport.is_closing():
            self._refuse(431, f"The request head is larger than {self.limits.max_header_bytes} bytes.")

    def _release_held(self) -> None:
        """Parse what was held back once an answer has made room in the queue."""
        if self._held and not self._lingering and not self.transport.is_closing() \
                and self.transport.get_protocol() is self:
            self._feed(self._held)
            if not self._held:
                self.flow.resume_reading()

    # --- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._oversized:
            return
        if not self._head_clock:  # a head that began in the same read as the previous body
            self._head_clock = True
            self._arm(self.limits.header_timeout_s)
        super().on_message_begin()
        callbacks: list[Callable[[], None]] = []
        self._on_disconnect.append(callbacks)
        self.scope["extensions"] = {DISCONNECT_EXTENSION: callbacks.append}  # type: ignore[typeddict-unknown-key]

    def on_headers_complete(self) -> None:
        if self._oversized:
            return
        # Counted only when the bytes read since the head began could exceed the limit.
        if self._head_bytes > self.limits.max_header_bytes and (
            len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > self.limits.max_header_bytes
        ):
            self._oversized = True  # refused once the parser returns
            return
        self._in_head = self._head_clock = False
        self._in_body = True
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()
        cycle = self.cycle
        if self.access_log and cycle is not None and cycle.scope is self.scope:
            request_id = _request_id(self.headers)
            if request_id is not None:
                cycle.access_logger = _RequestAccessLog(self.access_logger, {"request_id": request_id})

    def on_body(self, body: bytes) -> None:
        if not self._oversized:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._oversized:
            return
        # What follows is the next request's head (pipelined or after keep-alive).
        self._in_body = False
        self._in_head = True
        self._head_bytes = 0
        self._disarm()
        super().on_message_complete()

    # --- helpers ------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        # A deadline, not a timer per request: one sweep a second (or faster for short
        # timeouts) checks every connection of the server, which costs the request path
        # nothing but this assignment.
        self._deadline = self.loop.time() + seconds
        _Sweeper.ensure(self)

    def _disarm(self) -> None:
        self._deadline = math.inf

    def _timed_out(self) -> None:
        self._deadline = math.inf
        if self.transport.is_closing():
            return
        if self._in_head:
            self._refuse(408, f"The request head did not arrive within {self.limits.header_timeout_s:g} seconds.")
        elif self._in_body:
            if self.cycle is not None and not self.cycle.response_started:
                self._refuse(408, f"The request body did not arrive within {self.limits.body_timeout_s:g} seconds.")
            else:
                self.transport.close()

    def _overflow(self) -> None:
        """Too much held back past a full queue: close. No answer is written: the queued
        requests are not answered yet, and HTTP/1.1 answers in order."""
        self._held = b""
        self.pipeline.clear()
        self._disarm()
        self.transport.close()

    def _refuse(self, status: int, message: str, *, retry_after: bool = False) -> None:
        """Answer `status` and close, whatever state the exchange is in (nothing was sent)."""
        self._disarm()
        self._in_head = self._in_body = False
        if self.cycle is not None and not self.cycle.response_complete:
            # The app (if it runs) sees the client gone; it must not write after us.
            self.cycle.disconnected = True
            self.cycle.response_complete = True
            self.cycle.message_event.set()
        content_type, body = self.error_body(status, message)
        head = [STATUS_LINE[status], b"content-type: ", content_type.encode(), b"\r\n",
                b"content-length: ", str(len(body)).encode(), b"\r\n", b"connection: close\r\n"]
        if retry_after:
            head += [b"retry-after: ", str(self.limits.retry_after_s).encode(), b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = True
        self.loop.call_later(LINGER_S, self.transport.close)


def _after_heads(data: bytes, n: int) -> int:
    """The offset just past the n-th possible end of a request head in `data` (len(data)
    if there are fewer): parsing up to there queues at most n requests. A head ends at a
    blank line (CRLF CRLF, or LF LF, which the parser also accepts); the same bytes in a
    body only make the cut earlier, which costs a call, never correctness (the parser
    takes its input in pieces of any size)."""
    at = 0
    for _ in range(n):
        crlf = data.find(b"\n\r\n", at)
        lf = data.find(b"\n\n", at)
        if crlf < 0 and lf < 0:
            return len(data)
        at = (min(crlf, lf) if crlf >= 0 and lf >= 0 else max(crlf, lf)) + 2
        at += data[at - 1:at] == b"\r"  # past the CRLF CRLF's last LF
    return at


def _speaks_h2(first: bytes) -> bool | None:
    """Whether a connection whose first bytes are `first` speaks HTTP/2 by prior knowledge
    (meridian.http2); None while too few bytes have come to tell."""
    n = min(len(first), len(H2_PREFACE))
    if first[:n] != H2_PREFACE[:n]:
        return False
    return True if n == len(H2_PREFACE) else None


class _PerClient:
    """Live transports of one server by client address (closed ones are dropped as met)."""

    _servers: ClassVar[weakref.WeakKeyDictionary[Any, dict[str, list[Any]]]] = weakref.WeakKeyDictionary()
    _PRUNE_EVERY = 1024

    @classmethod
    def admit(cls, protocol: LimitedHttpToolsProtocol, transport: Any) -> bool:
        peer = transport.get_extra_info("peername")
        if not peer:
            return True
        table = cls._servers.setdefault(protocol.server_state, {})
        if len(table) >= cls._PRUNE_EVERY:
            for host in [h for h, ts in table.items() if all(t.is_closing() for t in ts)]:
                del table[host]
        live = [t for t in table.get(peer[0], ()) if not t.is_closing()]
        if len(live) >= protocol.limits.max_connections_per_client:
            table[peer[0]] = live
            return False
        table[peer[0]] = [*live, transport]
        return True


class _Sweeper:
    """Times out the connections of one server whose deadline has passed, every `period`."""

    _running: ClassVar[weakref.WeakKeyDictionary[Any, _Sweeper]] = weakref.WeakKeyDictionary()

    def __init__(self, protocol: LimitedHttpToolsProtocol) -> None:
        limits = protocol.limits
        self._connections = protocol.connections
        self._loop = protocol.loop
        self._period = min(1.0, limits.header_timeout_s / 4, limits.body_timeout_s / 4)
        self._loop.call_later(self._period, self._sweep)

    @classmethod
    def ensure(cls, protocol: LimitedHttpToolsProtocol) -> None:
        """Start the sweep of this protocol's server unless it runs."""
        state = protocol.server_state
        if state not in cls._running:
            cls._running[state] = cls(protocol)

    def _sweep(self) -> None:
        now = self._loop.time()
        armed = False
        for conn in list(self._connections):
            deadline = getattr(conn, "_deadline", math.inf)
            if deadline <= now:
                conn._timed_out()
            armed = armed or getattr(conn, "_deadline", math.inf) < math.inf
        if armed or self._connections:
            self._loop.call_later(self._period, self._sweep)
        else:
            for state, sweeper in list(self._running.items()):
                if sweeper is self:
                    del self._running[state]


class _RequestAccessLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """uvicorn's access logger for one request: its line gets the request's fields."""


def _request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's x-request-id when it is a sane token (REQUEST_ID_PATTERN), else None."""
    for name, value in headers:
        if name == _REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            return text if _SANE_REQUEST_ID.match(text) else None
    return None


def limited_protocol(limits: ListenerLimits, error_body: ErrorBody = openai_error_body,
                     h2: H2Handoff | None = None) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for uvicorn.Config(http=...) with these limits and error format
    (and HTTP/2 connections handed to `h2`, when given)."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,),
                {"limits": limits, "error_body": staticmethod(error_body), "h2": h2})


def limited_config(app: Any, settings: ListenerSettings, error_body: ErrorBody = openai_error_body,
                   *, http2_max_streams: int | None = None, **kwargs: Any) -> Config:
    """uvicorn's Config for `app` served over the httptools protocol with the listener
    limits of `settings`; with `http2_max_streams`, HTTP/2 is served on the same port too
    (meridian.http2). Logging is meridian.logs' (configure_logging), not uvicorn's."""
    kwargs.setdefault("log_config", None)
    kwargs.setdefault("timeout_keep_alive", SERVER_KEEPALIVE_S)
    limits = ListenerLimits.of(settings)
    if http2_max_streams is None:
        return Config(app, http=limited_protocol(limits, error_body), **kwargs)
    # Imported here: only listeners that serve HTTP/2 (the router's public one) load hypercorn.
    from meridian.http2 import AlpnConfig, H2Handoff

    h2 = H2Handoff(app, max_streams=http2_max_streams, max_header_bytes=limits.max_header_bytes,
                   keep_alive_s=kwargs["timeout_keep_alive"],
                   max_control_frames_per_s=settings.http2_max_control_frames_per_s,
                   body_timeout_s=limits.body_timeout_s, error_body=error_body)
    return AlpnConfig(app, http=limited_protocol(limits, error_body, h2), **kwargs)
