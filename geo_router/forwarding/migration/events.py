"""Events of a migratable stream: parsing the node's, and writing the client's.

The first piece of a stream is the node's own events, passed on with only the token ids
taken out (unless the client asked for them). A continuation is a /v1/completions stream
from the next node; `Continuation` turns each of its events into the event the client's
API would have sent (same `id`, `created`, `model`), checks stop strings across the seam
(text held back before it plus the new text), and writes the stream's tail: the usage the
client asked for, counting every token it received, and the `meridian` field saying how
many times the stream moved and where it ended.

With tools (plan.tools) the continuation's text goes through a replay of vLLM's pythonic
tool parser (tool_calls.PythonicStream) once the generated text starts with `[`, as vLLM
decides: the client gets the calls' deltas (new calls with new ids, the rest of started
ones), and finish_reason "tool_calls" where the node would say it. Text that contradicts the
calls already sent ends the stream with an error event (ToolCallMismatch).
"""

from __future__ import annotations

from typing import Any

import msgspec

from meridian.stop_strings import StopStringMatcher

from .ledger import StreamLedger
from .plan import Api, MigrationPlan
from .tool_calls import PythonicStream, starts_tool_calls

DONE = b"data: [DONE]\n\n"
_DECODE = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder()


def encode(event: dict[str, Any]) -> bytes:
    return b"data: " + _ENCODE.encode(event) + b"\n\n"


def for_client(plan: MigrationPlan, event: dict[str, Any]) -> dict[str, Any]:
    """The event without the token ids the router asked for (the client did not)."""
    if plan.client_wants_token_ids:
        return event
    event.pop("prompt_token_ids", None)
    for choice in event.get("choices") or ():
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
    return event


def is_error(event: dict[str, Any]) -> bool:
    return "error" in event and "choices" not in event


class Continuation:
    """One continuation piece: the next node's completions events, in the client's format."""

    def __init__(self, plan: MigrationPlan, ledger: StreamLedger, held: str,
                 trailer: dict[str, Any] | None, repeated: int = 0, tool_text: str | None = None) -> None:
        self._plan, self._ledger, self._trailer = plan, ledger, trailer
        # With tools: the generated text the node's parser had read before the seam ("" while
        # nothing says whether this is content or calls); None: plain content.
        self._tool_text = tool_text
        self._replay: PythonicStream | None = None
        self._stops = StopStringMatcher(plan.stops)
        self._held = held
        # Ids the continuation generates again (it started before the break, at a clean
        # character boundary): their text is new to the client, their ids are not.
        self._repeated = repeated
        self.finished = False

    def events(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The client's events for one event of the continuation (none, one, or the tail)."""
        choices = event.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None or self.finished:
            return []  # the node's own usage chunk: the router writes the stream's
        ids = choice.get("token_ids")
        if isinstance(ids, list) and self._repeated:
            ids, self._repeated = ids[self._repeated:], max(0, self._repeated - len(ids))
        text = self._held + (choice.get("text") if isinstance(choice.get("text"), str) else "")
        self._held = ""
        emit, stopped = self._stops.feed(text)
        reason = choice.get("finish_reason")
        if stopped:
            if self._plan.include_stop_str and self._stops.matched:
                emit += self._stops.matched
            reason = "stop"
        elif isinstance(reason, str):
            emit += self._stops.flush()
        message = self._message(emit)
        if reason == "stop" and self._plan.tools and (self._ledger.tool_calls or (message or {}).get("tool_calls")):
            reason = "tool_calls"  # vLLM's finish for auto tool calls that stopped on their own
        out = self._shaped(message, ids if isinstance(ids, list) else [], reason if isinstance(reason, str) else None)
        if out is None:
            return []
        if out["choices"][0]["finish_reason"] is None:
            return [out]
        self.finished = True
        return self.tail(out)

    def _message(self, emit: str) -> dict[str, Any] | None:
        """The chat delta for the text `emit`: content, or (tool mode) what vLLM's pythonic
        parser sends for the whole text so far. Raises ToolCallMismatch."""
        if self._tool_text is not None:
            self._tool_text += emit
            if self._tool_text and not starts_tool_calls(self._tool_text):
                self._tool_text = None  # the first text decides, as in vLLM: content from here on
        if self._tool_text is None or self._plan.api is not Api.CHAT:
            return {"content": emit} if emit else None
        if not self._tool_text:
            return None
        if self._replay is None:
            self._replay = PythonicStream(self._ledger.tool_calls)
        message = self._replay.feed(self._tool_text)
        if message and message.get("tool_calls") and not self._plan.parallel_tool_calls:
            message["tool_calls"] = [c for c in message["tool_calls"] if c["index"] == 0]
        return message

    def tail(self, last: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The stream's last events: `last` (its finish), then the usage chunk if asked for.
        The final one carries the `meridian` trailer."""
        out = [last] if last is not None else []
        if self._plan.include_usage and not self._ledger.usage_sent:
            out.append(self._envelope([], usage=True, pending=_ids_in(last)))
        if out and self._trailer is not None:
            out[-1]["meridian"] = self._trailer
        return out

    def _shaped(self, message: dict[str, Any] | None, ids: list[Any], reason: str | None) -> dict[str, Any] | None:
        if not message and not ids and reason is None:
            return None
        if self._plan.api is Api.CHAT:
            choice: dict[str, Any] = {"index": 0, "delta": message or {}, "logprobs": None, "finish_reason": reason}
        else:
            text = (message or {}).get("content") or ""
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        choice["token_ids"] = ids
        return self._envelope([choice], usage=self._plan.continuous_usage, pending=len(ids))

    def _envelope(self, choices: list[dict[str, Any]], usage: bool, pending: int = 0) -> dict[str, Any]:
        """An event of the client's API; `pending`: ids it carries that the ledger has not read."""
        ledger = self._ledger
        event: dict[str, Any] = {
            "id": ledger.id, "object": "chat.completion.chunk" if self._plan.api is Api.CHAT else "text_completion",
            "created": ledger.created, "model": ledger.model, "choices": choices,
        }
        if ledger.system_fingerprint is not None:
            event["system_fingerprint"] = ledger.system_fingerprint
        if usage:
            counts = ledger.usage()
            counts["completion_tokens"] += pending
            counts["total_tokens"] += pending
            event["usage"] = counts
        return event


def tool_seam(ledger: StreamLedger, text: str | None, stops: tuple[str, ...]) -> tuple[str | None, str] | None:
    """For a request with tools: the text the node's tool parser had read before the seam
    (None: the stream is content, the usual seam applies) and the text held back for a
    possible stop string after it; None when the stream cannot resume (calls were sent but
    the text is not a pythonic call list, or the replica could not say what the text is)."""
    if ledger.delivered_text:
        return None if ledger.tool_calls else (None, "")
    if text is None:
        return None
    if text and not starts_tool_calls(text):
        return None if ledger.tool_calls else (None, "")
    emit, _ = StopStringMatcher(stops).feed(text)  # what the node had released to its parser
    return emit, text[len(emit):]


def _ids_in(event: dict[str, Any] | None) -> int:
    if event is None:
        return 0
    return sum(len(c.get("token_ids") or ()) for c in event.get("choices") or () if isinstance(c, dict))
