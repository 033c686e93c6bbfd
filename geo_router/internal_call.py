"""A request of another protocol (a WebSocket turn, a gRPC inference) as the HTTP request
the router's pipeline serves, and its answer as a stream of parts.

Why: one pipeline behind every protocol (DESIGN.md): the app's `_route` authenticates,
limits, applies residency, orders replicas, forwards, fails over, migrates, accounts and
logs. Another protocol makes an ASGI request from its own headers and body, awaits the
route's Response and runs it with a `send` that hands each part over (`answer`). The
client leaving is the HTTP client leaving: `receive` says `http.disconnect` and the
listener's disconnect callbacks run, which cancels the forward and closes the node's
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from meridian.http_server import DISCONNECT_EXTENSION

from .migration.events import split_events
from .sse import SSEFramer

Route = Callable[[Request], Awaitable[Response]]
_DECODE = msgspec.json.Decoder()
# Responses whose __call__ sends their status, headers and body, and does nothing else.
_WHOLE = (Response, JSONResponse)
# Headers of the outer protocol that mean nothing to the HTTP request made from it.
_HOP = frozenset({b"content-length", b"content-type", b"upgrade", b"connection", b"te", b"sec-websocket-key",
                  b"sec-websocket-version", b"sec-websocket-extensions", b"sec-websocket-protocol"})


@dataclass
class Departure:
    """Whether the outer client has gone, and who to tell when it goes."""

    gone: asyncio.Event = field(default_factory=asyncio.Event)
    _callbacks: list[Callable[[], None]] = field(default_factory=list)

    def register(self, callback: Callable[[], None]) -> None:
        if self.gone.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def left(self) -> None:
        if self.gone.is_set():
            return
        self.gone.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


@dataclass(frozen=True, slots=True)
class Head:
    """The answer's status line and headers (names lower-case)."""

    status: int
    headers: dict[str, str]

    @property
    def streamed(self) -> bool:
        return self.status == 200 and self.headers.get("content-type", "").startswith("text/event-stream")


def http_request(path: str, headers: list[tuple[bytes, bytes]], body: bytes, departure: Departure,
                 *, client: tuple[str, int] | None, scheme: str = "http", app: Any = None) -> Request:
    """The POST `path` with a JSON `body` that the pipeline serves."""
    kept = [(k.lower(), v) for k, v in headers if k.lower() not in _HOP]
    kept += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": scheme, "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": kept, "client": client, "server": None, "state": {}, "app": app,
             "extensions": {DISCONNECT_EXTENSION: departure.register}}
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await departure.gone.wait()
        return {"type": "http.disconnect"}

    return Request(scope, receive)


async def answer(response: Response, request: Request) -> AsyncIterator[Head | bytes]:
    """The parts of `response` as it is sent: its Head, then each body chunk. Closing the
    iterator early (the outer client left) ends the response as a client hang-up would."""
    if type(response) in _WHOLE and response.background is None:
        # A whole answer (every non-streamed one) is its fields: sending it is only that.
        yield Head(response.status_code, {k.decode("latin-1"): v.decode("latin-1") for k, v in response.raw_headers})
        if response.body:
            yield bytes(response.body)
        return
    parts: asyncio.Queue[Head | bytes | None] = asyncio.Queue(maxsize=1)  # back-pressure

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
            await parts.put(Head(message["status"], headers))
        elif message["type"] == "http.response.body" and message.get("body"):
            await parts.put(message["body"])

    async def run() -> None:
        try:
            await response(request.scope, request.receive, send)
        finally:
            await parts.put(None)

    task = asyncio.create_task(run(), name="internal-call")
    try:
        while (part := await parts.get()) is not None:
            yield part
        await task  # its error, if any, is the caller's
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def answer_events(response: Response, request: Request) -> AsyncIterator[Head | dict[str, Any] | bytes]:
    """`answer` as its consumers read it: the Head, then a streamed answer's events (each
    whole SSE event's JSON; `[DONE]` and anything not JSON left out) or any other answer's
    whole body. Run it under contextlib.aclosing: leaving early must end the answer."""
    head, body = Head(500, {}), b""
    framer = SSEFramer(True)
    parts = answer(response, request)
    try:
        async for part in parts:
            if isinstance(part, Head):
                head = part
                yield head
            elif not head.streamed:
                body += part
            else:
                for _, event in split_events(framer.feed(part)):
                    if event is not None:
                        yield event
    finally:
        await parts.aclose()
    if not head.streamed:
        yield body
        return
    for _, event in split_events(framer.flush()):
        if event is not None:
            yield event


def json_of(body: bytes) -> Any:
    """A non-streamed answer's JSON (None when it is not JSON)."""
    try:
        return _DECODE.decode(body)
    except msgspec.DecodeError:
        return None


def error_object(payload: Any, status: int) -> dict[str, Any]:
    """The OpenAI error object of an error answer's JSON; one naming the status when the
    answer carried none (a proxy's HTML page, an empty body)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error
    return {"type": "server_error" if status >= 500 else "invalid_request_error", "code": None, "param": None,
            "message": f"The request failed with HTTP status {status}."}

