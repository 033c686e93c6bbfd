"""The answer to a WebSocket turn or a gRPC call, as a stream of parts its front end reads.

Why: one pipeline behind every protocol (DESIGN.md): the app's `_route` authenticates,
limits, applies residency, orders replicas, forwards, fails over, migrates, accounts and
logs. A front end hands it its request as a CallArrival (geo_router.ingress.arrival) and
gets the pipeline's Response back; `answer` runs that Response with a `send` that hands each
part over, and `answer_events` reads the parts as events. The client leaving ends it: the
front end stops reading (closing the iterator cancels the answer, which closes the node's
connection), and the arrival's Departure has already cancelled a forward still waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from ..sse import SSEFramer, split_events
from .arrival import Arrival, Departure

Route = Callable[[Arrival], Awaitable[Response]]
_DECODE = msgspec.json.Decoder()
# Responses whose __call__ sends their status, headers and body, and does nothing else.
_WHOLE = (Response, JSONResponse)
# What a Response reads of the scope it is sent in. ASGI spec 2.4: a send never fails for a
# client gone (the Departure cancels the answer instead), so a StreamingResponse runs no
# task listening for a disconnect beside the one that sends.
_SCOPE: dict[str, Any] = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}


async def _never_disconnected() -> Message:
    await asyncio.Future()  # the answer ends by being closed, not by a disconnect message
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class Head:
    """The answer's status line and headers (names lower-case)."""

    status: int
    headers: dict[str, str]

    @property
    def streamed(self) -> bool:
        return self.status == 200 and self.headers.get("content-type", "").startswith("text/event-stream")


async def answer(response: Response, departure: Departure) -> AsyncIterator[Head | bytes]:
    """The parts of `response` as it is sent: its Head, then each body chunk. The client
    leaving (`departure`) ends a streamed answer at once, as does closing the iterator
    early: the answer stops as for a client hang-up, and the parts end."""
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
            await response(_SCOPE, _never_disconnected, send)
        finally:
            await parts.put(None)

    task = asyncio.create_task(run(), name="internal-call")
    # Between two parts of a slow stream nothing else would notice the client leaving.
    unregister = departure.register(task.cancel)
    try:
        while (part := await parts.get()) is not None:
            yield part
        if not task.cancelled():  # cancelled: the client left, and the answer ends here
            await task  # its error, if any, is the caller's
    finally:
        unregister()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def answer_events(response: Response, departure: Departure) -> AsyncIterator[Head | dict[str, Any] | bytes]:
    """`answer` as its consumers read it: the Head, then a streamed answer's events (each
    whole SSE event's JSON; `[DONE]` and anything not JSON left out) or any other answer's
    whole body. Run it under contextlib.aclosing: leaving early must end the answer."""
    head, body = Head(500, {}), b""
    framer = SSEFramer(True)
    parts = answer(response, departure)
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

