"""The server's side of a Responses WebSocket: streamed HTTP answers as socket messages.

Each event the streamed HTTP Responses API sends (`event: <type>` + `data: <json>`) is one
text message on the socket, its JSON unchanged, plus the turn's `stream_id` when it has one
(OpenAI's lanes). An error the router answers before streaming (a RouterError: bad key,
rate limit, no replica in the zone) is OpenAI's WebSocket `error` event, which carries the
HTTP status and the error object (with its headers: `retry-after` on a 429 or 503); an
error event inside a stream (a stream that broke and could not move) is passed on in the
same shape. Pure: geo_router.ingress.websocket.endpoint sends what these return.
"""

from __future__ import annotations

from typing import Any

from meridian.errors import OpenAIError

from ..internal_call import error_object, json_of

# Events after which a turn is over (the response object they carry is the turn's result).
FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def error_message(exc: OpenAIError, lane: str | None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """OpenAI's WebSocket `error` event for an error answered instead of a stream."""
    error = dict(exc.body()["error"])
    shown = {k: v for k, v in (headers if headers is not None else exc.headers).items()
             if k.lower() in ("retry-after", "x-request-id", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens")}
    if shown:
        error["headers"] = shown
    return _laned({"type": "error", "status": exc.status, "error": error}, lane)


def answered_error(status: int, body: bytes, headers: dict[str, str], lane: str | None) -> dict[str, Any]:
    """The `error` event for a non-streamed answer (an error JSON the node or router wrote)."""
    error = error_object(json_of(body), status)
    exc = OpenAIError(error["message"], status=status, code=_str(error.get("code")), param=_str(error.get("param")))
    if isinstance(error.get("type"), str):
        exc.type_ = error["type"]  # the answering part's own type (a node's, vLLM's)
    return error_message(exc, lane, headers)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def socket_message(event: dict[str, Any], lane: str | None) -> dict[str, Any]:
    """The socket message for one event of the streamed HTTP answer (its JSON)."""
    if "type" not in event and isinstance(event.get("error"), dict):
        # The router's own mid-stream error event (geo_router.sse.error_event).
        event = {"type": "error", "error": event["error"]}
    return _laned(event, lane)


def warm_up_messages(response: dict[str, Any], lane: str | None) -> list[dict[str, Any]]:
    """The events of a `generate: false` turn: created, then completed, with no output."""
    created = {**response, "status": "in_progress", "usage": None}
    return [_laned({"type": "response.created", "sequence_number": 0, "response": created}, lane),
            _laned({"type": "response.completed", "sequence_number": 1, "response": response}, lane)]


def _laned(event: dict[str, Any], lane: str | None) -> dict[str, Any]:
    if lane is not None:
        event["stream_id"] = lane
    return event
