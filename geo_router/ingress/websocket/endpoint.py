"""The Responses API's WebSocket mode: `GET /v1/responses` upgraded, one turn at a time.

The client authenticates on the upgrade (its API key, as on HTTP: a bad one is answered
401 with OpenAI's error JSON and no socket), then sends `response.create` events and
receives, for each, the events the streamed HTTP Responses API sends (one JSON text message
each). Each turn is one streamed `POST /v1/responses` through the router's own pipeline
(`route`: the app's, with tenant, limits, residency, candidates, affinity, forwarding,
failover, migration, accounting, access log and tracing): an ASGI request is made from the
upgrade's headers and the turn's body, and the answer it gets is written to the socket. So
nothing about routing, residency or limits is WebSocket-specific.

Every turn is a request, a warm-up (`generate: false`) too. A warm-up is answered by the
router itself (geo_router.ingress.websocket.conversation keeps its input), but only once the
pipeline has admitted it as it admits any request: the key, max_request_bytes (413
`request_too_large`), the tenant's rate limits (429 `rate_limit_exceeded`, with
retry-after), and accounting, access log and tracing as one request of the 0 tokens its
usage reports. Why: a warm-up keeps what it is sent, and one that skipped the checks let
any key (or none) grow the router's memory without bound.

The key. It is looked up again before every turn and, while the connection idles, every
ws_key_recheck_s on the router's clock (one dict lookup of its digest, hashed once at the
upgrade): a key the routing table no longer has (revoked, expired, its tenant deleted)
gets an `error` event (401 `invalid_api_key`) and the connection is closed 1008 (policy
violation). A turn already streaming ends as an HTTP request would: it was admitted.

Memory. What a connection remembers between turns is capped in bytes of JSON:
ws_max_lane_bytes per lane (default 8 MB) and ws_max_socket_bytes for all its lanes
(default 32 MB; see RouterSettings for why). A turn that would go past either gets

    {"type": "error", "status": 400, "error": {"type": "invalid_request_error",
     "code": "conversation_too_large", "param": "input", "message": "..."}}

(plus its `stream_id`), before any rate-limit charge or model call; nothing of it is kept,
the lane keeps its previous response, and the connection stays open. A generated turn
whose output takes its lane past a cap is answered but not kept: continuing it gets the
same error (param `previous_response_id`).

Turns of one connection run one after another, in the order sent (events that arrive
during a turn wait; at most ws_max_lanes * 4 of them, beyond which the connection is closed
1008, since a client that floods cannot be served anyway). A bad event is answered with an
`error` event and the connection stays open. The client leaving mid-turn is the HTTP
client leaving: the forward is cancelled and the node's request with it. A connection idle
for ws_idle_timeout_s, or open for ws_max_connection_s, is closed between turns with 1001
(going away), on which OpenAI's client reconnects. Message size is uvicorn's ws_max_size
(= max_request_bytes; larger closes 1009), and its pings find dead peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from meridian.clock import Clock, first_or_timeout
from meridian.contracts import Route
from meridian.settings.router import RouterSettings

from ...errors import InvalidApiKey, RequestTooLarge, RouterError, error_response
from ..arrival import Arrival, CallArrival, Departure
from ..internal_call import Head, answer_events
from .conversation import Conversation, Turn
from .events import FINAL, answered_error, error_message, socket_message, warm_up_messages

# The router's own answer to a request the pipeline admitted (a warm-up's), made only then.
Answer = Callable[[], Response]
# Whether the upgrade's API key is still one the routing table has.
KeyCheck = Callable[[], bool]


class TurnRoute(Protocol):
    """The app's pipeline for one turn: forwarded, or with `answer` answered by the router."""

    def __call__(self, arrival: Arrival, answer: Answer | None = None, /) -> Awaitable[Response]: ...


log = logging.getLogger(__name__)
# A turn's answer is a dozen events, each written as JSON: msgspec's writer, not the stdlib's.
_ENCODE = msgspec.json.Encoder()

RESPONSES_PATH = Route.RESPONSES
# WebSocket close codes (RFC 6455 7.4.1).
GOING_AWAY = 1001
POLICY_VIOLATION = 1008

class ResponsesSocket:
    """One accepted connection: reads events, runs turns, writes their events."""

    def __init__(self, ws: WebSocket, settings: RouterSettings, clock: Clock, route: TurnRoute,
                 key_holds: KeyCheck) -> None:
        self._ws = ws
        self._settings = settings
        self._clock = clock
        self._route = route
        self._key_check = key_holds
        self._conversation = Conversation(max_lanes=settings.ws_max_lanes,
                                          max_lane_bytes=settings.ws_max_lane_bytes,
                                          max_socket_bytes=settings.ws_max_socket_bytes)
        self._inbox: asyncio.Queue[str | None] = asyncio.Queue(maxsize=settings.ws_max_lanes * 4)
        self._departure = Departure()
        self._checked = clock.monotonic()  # the upgrade checked the key

    async def run(self) -> None:
        await self._ws.accept()
        reader = asyncio.create_task(self._read(), name="ws-reader")
        try:
            await self._serve()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _serve(self) -> None:
        """Turns until the client leaves, the key goes, or the connection's time is up.

        The wait for the next event ends at the earliest of the connection's end, its idle
        end and the next key check; a check does not restart the idle time, a turn does."""
        s = self._settings
        opened = idle_from = self._clock.monotonic()
        while True:
            now = self._clock.monotonic()
            if now - self._checked >= s.ws_key_recheck_s and not await self._key_holds():
                return
            ends = min(opened + s.ws_max_connection_s, idle_from + s.ws_idle_timeout_s)
            if ends <= now:
                await self._close(GOING_AWAY, "idle or open too long: reconnect")
                return
            text = await self._next(min(ends, self._checked + s.ws_key_recheck_s) - now)
            if text is None:
                if self._departure.gone.is_set():
                    return
                continue  # a time came: the loop sees which
            if not await self._turn(text):
                return
            idle_from = self._clock.monotonic()

    async def _key_holds(self) -> bool:
        """Whether the key still holds; when not, says so and closes the connection 1008."""
        self._checked = self._clock.monotonic()
        if self._key_check():
            return True
        await self.send_event(error_message(InvalidApiKey("The API key was revoked or has expired."), None))
        await self._close(POLICY_VIOLATION, "the API key was revoked or has expired")
        return False

    async def _next(self, seconds: float) -> str | None:
        """The next event's text; None when the time passed or the client left."""
        if not self._inbox.empty():
            return self._inbox.get_nowait()
        if seconds <= 0:
            return None
        getting = asyncio.ensure_future(self._inbox.get())
        try:
            done = await first_or_timeout(self._clock, seconds, getting)
        finally:
            getting.cancel()
        return getting.result() if done else None

    async def _read(self) -> None:
        try:
            while True:
                message = await self._ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is None:
                    raw = message.get("bytes") or b""
                    text = raw.decode("utf-8", "replace")
                try:
                    self._inbox.put_nowait(text)
                except asyncio.QueueFull:
                    await self._close(POLICY_VIOLATION, "too many events waiting: one response at a time")
                    break
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            self._left()

    def _left(self) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._inbox.put_nowait(None)
        self._departure.left()

    async def _turn(self, text: str) -> bool:
        """Run one turn; False when the connection was closed for its key."""
        if not await self._key_holds():
            return False
        try:
            event = json.loads(text)
        except ValueError:
            await self.send_event(error_message(RouterError("The message is not JSON.", status=400), None))
            return True
        lane = event.get("stream_id") if isinstance(event, dict) and isinstance(event.get("stream_id"), str) else None
        try:
            turn = self._conversation.prepare(event)
            if len(turn.body) > self._settings.max_request_bytes:
                raise RequestTooLarge(self._settings.max_request_bytes)
            self._conversation.room_for(turn)
        except RouterError as exc:
            await self.send_event(error_message(exc, lane))
            return True
        await self._answer(turn)
        return True

    async def _answer(self, turn: Turn) -> None:
        """The turn through the pipeline: forwarded, or a warm-up answered here once admitted."""
        ws = self._ws
        warmed: list[dict[str, Any]] = []

        def warm_up() -> Response:
            warmed.append(self._conversation.warm_up(turn))
            return JSONResponse(warmed[0])

        client = ws.scope.get("client")
        arrival = CallArrival(ws.scope["headers"], turn.body, client[0] if client else None, self._departure)
        try:
            response = await self._route(arrival, None if turn.generate else warm_up)
        except RouterError as exc:
            response = error_response(exc, arrival.request_id)
        except asyncio.CancelledError:
            if not self._departure.gone.is_set():
                raise
            return  # the client left while the turn waited (ClientWatch cancelled it)
        except Exception:
            log.exception("WebSocket turn failed")
            response = error_response(RouterError("The router hit an internal error.", status=500,
                                                  code="internal_error"))
        if warmed:
            for message in warm_up_messages(warmed[0], turn.lane):
                await self.send_event(message)
            return
        final = await self._relay(response, turn)
        if final is not None:
            self._conversation.record(turn, final)

    async def _relay(self, response: Response, turn: Turn) -> dict[str, Any] | None:
        """Write the turn's answer to the socket; the response object of its final event."""
        head, final = Head(500, {}), None
        async with contextlib.aclosing(answer_events(response, self._departure)) as parts:
            async for part in parts:
                if isinstance(part, Head):
                    head = part
                elif isinstance(part, bytes):
                    await self.send_event(answered_error(head.status, part, head.headers, turn.lane))
                else:
                    event = socket_message(part, turn.lane)
                    if event.get("type") in FINAL and isinstance(event.get("response"), dict):
                        final = event["response"]
                    if not await self.send_event(event):
                        return None  # the client left: leaving ends the answer
        return final

    async def send_event(self, message: dict[str, Any]) -> bool:
        if self._departure.gone.is_set() or self._ws.application_state != WebSocketState.CONNECTED:
            return False
        try:
            await self._ws.send_text(_ENCODE.encode(message).decode())
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._left()
            return False
        return True

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            if self._ws.application_state == WebSocketState.CONNECTED:
                await self._ws.close(code, reason)
