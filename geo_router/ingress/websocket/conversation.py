"""What a Responses WebSocket connection remembers between turns, and the turn it sends.

OpenAI's WebSocket mode keeps the connection's most recent response in the connection's
memory, so a `response.create` naming it in `previous_response_id` continues it even with
`store: false`: nothing was stored anywhere else. The router does the same, per lane (the
optional `stream_id` that multiplexes conversations on one socket): it keeps the previous
response's whole input and its output items, and a turn continuing it is sent to a node as
one self-contained request, the conversation so far followed by the new input, without
`previous_response_id`. Why the router and not a node: a node (and vLLM) would keep that
state in one process's memory, so the next turn could go nowhere else; sent whole, any
replica of the tenant's zone can serve it (the KV-prefix affinity prefers the one that
holds the conversation's prefix) and a node lost between turns costs only the re-prefill.

Anything else about the turn is the HTTP API's: a `previous_response_id` that this
connection did not make goes to the node as sent (a stored response, found where it lives),
and the same checks answer it. Only one response per lane is remembered, as OpenAI's
connection-local cache: chaining from an older unstored one is `previous_response_not_found`.
`generate: false` makes no model call: it records the turn's input (instructions, tools,
messages) as a response the next turn can continue, which is what a warm-up is for.

What is remembered is bounded, in bytes of JSON (the measure the next turn pays anyway): a
lane holds its last turn as sent (`Turn.body`: the conversation so far, the new input and
the turn's other fields) plus that turn's output, at most `max_lane_bytes`; the lanes of a
connection together hold at most `max_socket_bytes`. `room_for` refuses a turn that would
go past either (ConversationTooLarge: `conversation_too_large`, 400) before it is sent, so
nothing of it is kept and the lane keeps what it had. A generated turn whose output takes
its lane past a cap (the output's size is known only at the end) is not kept either: its
lane then remembers only the id, and a turn continuing it gets the same error, not
`previous_response_not_found`. Why caps in bytes and not turns: a warm-up chained on its
own lane grew a connection by its whole message per turn, and bytes are what memory costs.

Pure: no I/O, no clock; geo_router.ingress.websocket.endpoint does the talking.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...errors import BadRequest

CREATE = "response.create"
# Transport fields of POST /v1/responses that mean nothing on a socket (every turn streams).
_TRANSPORT = ("stream", "stream_options")
_ENCODE = msgspec.json.Encoder()


class PreviousResponseNotFound(BadRequest):
    code = "previous_response_not_found"

    def __init__(self, response_id: str) -> None:
        shown = response_id if len(response_id) <= 300 and response_id.isprintable() else "given"
        super().__init__(
            f"Previous response with id '{shown}' not found: this connection keeps only its most recent "
            "response (store it, with `store: true`, to continue an older one).",
            param="previous_response_id",
        )


class ConversationTooLarge(BadRequest):
    code = "conversation_too_large"

    def __init__(self, message: str, *, param: str = "input") -> None:
        super().__init__(message + " Start a new conversation (no `previous_response_id`), or store the "
                         "response (`store: true`) and continue that.", param=param)

    @classmethod
    def lane(cls, size: int, limit: int) -> ConversationTooLarge:
        return cls(f"This conversation would hold {size} bytes, over the limit of {limit} bytes per "
                   "conversation (`stream_id`) of a connection.")

    @classmethod
    def socket(cls, size: int, limit: int) -> ConversationTooLarge:
        return cls(f"This connection's conversations would hold {size} bytes, over the limit of {limit} "
                   "bytes per connection.")

    @classmethod
    def not_kept(cls) -> ConversationTooLarge:
        return cls("The previous response was not kept: with its output, its conversation went past this "
                   "connection's limit.", param="previous_response_id")


@dataclass(frozen=True, slots=True)
class Turn:
    """One `response.create`, ready to send: the streamed POST /v1/responses body (its
    payload, and as JSON), the conversation's input items it carries, and whether it
    generates at all."""

    lane: str | None
    payload: dict[str, Any]
    items: list[Any]
    generate: bool
    body: bytes


@dataclass(slots=True)
class _Previous:
    response_id: str
    items: list[Any]  # the whole conversation: every input item and the response's output
    size: int  # bytes it counts for (see the module's docstring)
    kept: bool = True  # False: over a cap, only the id is remembered


@dataclass(slots=True)
class Conversation:
    """The most recent response of each lane of one connection, within its byte caps."""

    max_lanes: int = 16
    max_lane_bytes: int = 8_000_000
    max_socket_bytes: int = 32_000_000
    _last: dict[str | None, _Previous] = field(default_factory=dict)

    @property
    def held(self) -> int:
        """The bytes this connection's lanes count for (a sum over at most max_lanes)."""
        return sum(previous.size for previous in self._last.values())

    def prepare(self, event: Any) -> Turn:
        """The turn `event` asks for (BadRequest, in the HTTP API's words, when it is not one)."""
        if not isinstance(event, dict):
            raise BadRequest("A WebSocket message must be a JSON object (an event).")
        kind = event.get("type")
        if kind != CREATE:
            shown = kind if isinstance(kind, str) and len(kind) <= 64 and kind.isprintable() else "given"
            raise BadRequest(f"Unsupported event type '{shown}': this endpoint takes `{CREATE}`.", param="type")
        lane = event.get("stream_id")
        if lane is not None and not (isinstance(lane, str) and 0 < len(lane) <= 64):
            raise BadRequest("`stream_id` must be a string of 1 to 64 characters.", param="stream_id")
        payload = {k: v for k, v in event.items() if k not in ("type", "stream_id", "generate", *_TRANSPORT)}
        generate = event.get("generate", True)
        if not isinstance(generate, bool):
            raise BadRequest("`generate` must be a boolean.", param="generate")
        if payload.get("background") not in (None, False):
            raise BadRequest("`background` is not supported over a WebSocket: every turn streams.", param="background")
        payload.pop("background", None)
        items = _items(payload.get("input"))
        previous = payload.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise BadRequest("`previous_response_id` must be a string.", param="previous_response_id")
            kept = self._last.get(lane)
            if kept is not None and kept.response_id == previous:
                if not kept.kept:
                    raise ConversationTooLarge.not_kept()
                items = kept.items + items
                del payload["previous_response_id"]
            elif _unstored(previous):
                raise PreviousResponseNotFound(previous)
        if not generate and previous is not None and "previous_response_id" in payload:
            raise BadRequest("A warm-up (`generate: false`) can continue only this connection's own response.",
                             param="previous_response_id")
        if items or "input" in payload:
            payload["input"] = items
        payload["stream"] = True
        if lane not in self._last and len(self._last) >= self.max_lanes:
            raise BadRequest(f"A connection holds at most {self.max_lanes} conversations (`stream_id`).",
                             param="stream_id")
        return Turn(lane, payload, items, generate, _json(payload))

    def room_for(self, turn: Turn) -> None:
        """ConversationTooLarge unless keeping `turn` (in place of its lane's last) stays within the caps."""
        self._check(turn.lane, len(turn.body))

    def record(self, turn: Turn, response: dict[str, Any]) -> None:
        """The turn's response is complete: it becomes the one its lane's next turn continues
        (only its id, when with its output it is over a cap)."""
        response_id = response.get("id")
        if not isinstance(response_id, str):
            return
        output = [_as_input(i) for i in response.get("output") or []]
        size = len(turn.body) + (len(_json(output)) if output else 0)
        try:
            self._check(turn.lane, size)
        except ConversationTooLarge:
            self._last[turn.lane] = _Previous(response_id, [], 0, kept=False)
            return
        self._last[turn.lane] = _Previous(response_id, turn.items + output, size)

    def _check(self, lane: str | None, size: int) -> None:
        if size > self.max_lane_bytes:
            raise ConversationTooLarge.lane(size, self.max_lane_bytes)
        kept = self._last.get(lane)
        total = self.held - (kept.size if kept is not None else 0) + size
        if total > self.max_socket_bytes:
            raise ConversationTooLarge.socket(total, self.max_socket_bytes)

    def warm_up(self, turn: Turn) -> dict[str, Any]:
        """Record a `generate: false` turn without a model call; the response object that says so."""
        response = {"id": f"resp_{secrets.token_hex(24)}", "object": "response", "status": "completed",
                    "model": turn.payload.get("model"), "output": [],
                    "instructions": turn.payload.get("instructions"), "tools": turn.payload.get("tools") or [],
                    "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}}
        self.record(turn, response)
        return response

    def holds(self, lane: str | None) -> str | None:
        """The id a turn of `lane` can continue (None when there is none yet)."""
        kept = self._last.get(lane)
        return kept.response_id if kept is not None else None


def _json(value: Any) -> bytes:
    return _ENCODE.encode(value)


def _items(value: Any) -> list[Any]:
    """`input` as a list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise BadRequest("`input` must be a string or a list of input items.", param="input")


def _as_input(item: Any) -> Any:
    """An output item as the next turn's input item: what the API returned, less the fields
    that describe the answer rather than the message (a message's `status` stays: vLLM reads
    an unfinished assistant message as one to continue)."""
    if isinstance(item, dict) and item.get("type") == "message":
        return {k: v for k, v in item.items() if k in ("type", "role", "content", "id", "status")}
    return item


def _unstored(response_id: str) -> bool:
    """An id the router wrote for a response nothing stored (its own warm-ups, or a plain
    unstored stream's): without this connection's memory of it, no node can continue it.
    A node's stored response carries its node in the id (geo_router.ingress.responses)."""
    return response_id.startswith("resp_") and "." not in response_id
