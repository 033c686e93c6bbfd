"""Events of a migratable stream: parsing the node's, and writing the client's.

The first piece of a stream is the node's own events, passed on with only the token ids
taken out (unless the client asked for them). A continuation is a /v1/completions stream
from the next node; `Continuation` turns each of its events into the event the client's
API would have sent (same `id`, `created`, `model`), checks stop strings across the seam
(text held back before it plus the new text), and writes the stream's tail: the usage the
client asked for, counting every token it received, and the `meridian` field saying how
many times the stream moved and where it ended.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from meridian.stop_strings import StopStringMatcher

from .ledger import StreamLedger
from .plan import Api, MigrationPlan

DONE = b"data: [DONE]\n\n"
_DECODE = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder()


def split_events(run: bytes) -> Iterator[tuple[bytes, dict[str, Any] | None]]:
    """Each whole SSE event of a run, with its JSON data (None: `[DONE]`, a comment, not JSON)."""
    for raw in run.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not raw.strip():
            continue
        data = None
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    value = _DECODE.decode(line[5:].strip())
                except (msgspec.DecodeError, UnicodeDecodeError):
                    value = None
                data = value if isinstance(value, dict) else None
        yield raw + b"\n\n", data


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
                 trailer: dict[str, Any] | None, repeated: int = 0) -> None:
        self._plan, self._ledger, self._trailer = plan, ledger, trailer
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
        out = self._shaped(emit, ids if isinstance(ids, list) else [], reason if isinstance(reason, str) else None)
        if out is None:
            return []
        if out["choices"][0]["finish_reason"] is None:
            return [out]
        self.finished = True
        return self.tail(out)

    def tail(self, last: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The stream's last events: `last` (its finish), then the usage chunk if asked for.
        The final one carries the `meridian` trailer."""
        out = [last] if last is not None else []
        if self._plan.include_usage and not self._ledger.usage_sent:
            out.append(self._envelope([], usage=True, pending=_ids_in(last)))
        if out and self._trailer is not None:
            out[-1]["meridian"] = self._trailer
        return out

    def _shaped(self, text: str, ids: list[Any], reason: str | None) -> dict[str, Any] | None:
        if not text and not ids and reason is None:
            return None
        if self._plan.api is Api.CHAT:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                      "logprobs": None, "finish_reason": reason}
        else:
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


def _ids_in(event: dict[str, Any] | None) -> int:
    if event is None:
        return 0
    return sum(len(c.get("token_ids") or ()) for c in event.get("choices") or () if isinstance(c, dict))
