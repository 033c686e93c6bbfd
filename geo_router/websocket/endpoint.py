"""The Responses API's WebSocket mode: `GET /v1/responses` upgraded, one turn at a time.

The client authenticates on the upgrade (its API key, as on HTTP: a bad one is answered
401 with OpenAI's error JSON and no socket), then sends `response.create` events and
receives, for each, the events the streamed HTTP Responses API sends (one JSON text message
each). Each turn is one streamed `POST /v1/responses` through the router's own pipeline
(`route`: the app's, with tenant, limits, residency, candidates, affinity, forwarding,
failover, migration, accounting, access log and tracing): an ASGI request is made from the
upgrade's headers and the turn's body, and the answer it gets is written to the socket. So
nothing about routing, residency or limits is WebSocket-specific, and the key is checked
again on every turn (a revoked key stops the next one).

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
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from meridian.clock import Clock, first_or_timeout
from meridian.settings import RouterSettings

from ..errors import RequestTooLarge, RouterError, error_response
from ..internal_call import Departure, Head, Route, answer_events, http_request
from .conversation import Conversation, Turn
from .events import FINAL, answered_error, error_message, socket_message, warm_up_messages

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
# WebSocket close codes (RFC 6455 7.4.1).
GOING_AWAY = 1001
POLICY_VIOLATION = 1008

class ResponsesSocket:
    """One accepted connection: reads events, runs turns, writes their events."""

    def __init__(self, ws: WebSocket, settings: RouterSettings, clock: Clock, route: Route) -> None:
        self._ws = ws
        self._settings = settings
        self._clock = clock
        self._route = route
        self._conversation = Conversation(max_lanes=settings.ws_max_lanes)
        self._inbox: asyncio.Queue[str | None] = asyncio.Queue(maxsize=settings.ws_max_lanes * 4)
        self._departure = Departure()

    async def run(self) -> None:
        await self._ws.accept()
        reader = asyncio.create_task(self._read(), name="ws-reader")
        opened = self._clock.monotonic()
        try:
            while True:
                left = opened + self._settings.ws_max_connection_s - self._clock.monotonic()
                text = await self._next(min(left, self._settings.ws_idle_timeout_s))
                if text is None:
                    break
                await self._turn(text)
            if not self._departure.gone.is_set():
                await self._close(GOING_AWAY, "idle or open too long: reconnect")
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

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

    async def _turn(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError:
            await self.send_event(error_message(RouterError("The message is not JSON.", status=400), None))
            return
        lane = event.get("stream_id") if isinstance(event, dict) and isinstance(event.get("stream_id"), str) else None
        try:
            turn = self._conversation.prepare(event)
        except RouterError as exc:
            await self.send_event(error_message(exc, lane))
            return
        if not turn.generate:
            for message in warm_up_messages(self._conversation.warm_up(turn), turn.lane):
                await self.send_event(message)
            return
        body = json.dumps(turn.payload, separators=(",", ":")).encode()
        if len(body) > self._settings.max_request_bytes:
            await self.send_event(error_message(RequestTooLarge(self._settings.max_request_bytes), turn.lane))
            return
        await self._forward(turn, body)

    async def _forward(self, turn: Turn, body: bytes) -> None:
        ws = self._ws
        request = http_request(RESPONSES_PATH, list(ws.scope["headers"]), body, self._departure,
                               client=ws.scope.get("client"), app=ws.scope.get("app"),
                               scheme="https" if ws.scope.get("scheme") == "wss" else "http")
        try:
            response = await self._route(request)
        except RouterError as exc:
            response = error_response(exc, getattr(request.state, "request_id", None))
        except asyncio.CancelledError:
            if not self._departure.gone.is_set():
                raise
            return  # the client left while the turn waited (ClientWatch cancelled it)
        except Exception:
            log.exception("WebSocket turn failed")
            response = error_response(RouterError("The router hit an internal error.", status=500,
                                                  code="internal_error"))
        final = await self._relay(response, request, turn)
        if final is not None:
            self._conversation.record(turn, final)

    async def _relay(self, response: Response, request: Request, turn: Turn) -> dict[str, Any] | None:
        """Write the turn's answer to the socket; the response object of its final event."""
        head, final = Head(500, {}), None
        async with contextlib.aclosing(answer_events(response, request)) as parts:
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
            await self._ws.send_text(json.dumps(message, separators=(",", ":")))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._left()
            return False
        return True

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            if self._ws.application_state == WebSocketState.CONNECTED:
                await self._ws.close(code, reason)
