"""A Responses API stream written from a (migrating) chat completion stream.

A plain streamed Responses request is served as a chat completion (responses.py); this
turns the chat chunks the client would have got, first piece and continuations alike,
into the events vLLM's own streamed /v1/responses sends for a plain text answer, in its
order and shapes: `response.created`, `response.in_progress`, the message item's
`response.output_item.added` and `response.content_part.added` (at its first text),
`response.output_text.delta` per chunk, then `response.output_text.done`,
`response.content_part.done`, `response.output_item.done` and `response.completed` with
the whole response (status `incomplete` when the token budget ran out, as vLLM says it).
Each event has an `event:` line and a `sequence_number` that counts up across seams;
there is one response id (`resp_` and the chat id's) and one message item id for the
whole stream, whichever nodes served it. The migration trailer (`meridian`) goes on
`response.completed`; an error event (a migration refused) becomes the Responses API's
`error` event, which ends the stream.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from ...sse import StreamTally, split_events
from ..streaming import CommittedStream, run_close_callbacks

_ENCODE = msgspec.json.Encoder()
_NOT_ID = re.compile(r"[^A-Za-z0-9]")


class ResponsesEvents:
    """The Responses events for the bytes of one chat completion stream, fed in order."""

    def __init__(self, echo: dict[str, Any]) -> None:
        self._echo = echo
        self._sequence = 0
        self._id: str | None = None
        self._item_id = ""
        self._created = 0
        self._model = ""
        self._text: list[str] = []
        self._opened = False
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._trailer: Any = None
        self.ended = False

    def feed(self, run: bytes) -> bytes:
        """The client's bytes for a run of whole chat events."""
        out = bytearray()
        for raw, data in split_events(run):
            if self.ended:
                break
            if data is None:
                if raw.startswith(b"data: [DONE]") or raw.startswith(b"data:[DONE]"):
                    out += self._finished()
                continue  # a comment: nothing the Responses client reads
            if "error" in data and "choices" not in data:
                out += self._error(data["error"])
                continue
            out += self._chunk(data)
        return bytes(out)

    def _chunk(self, chunk: dict[str, Any]) -> bytes:
        out = bytearray()
        if self._id is None:
            out += self._start(chunk)
        if isinstance(usage := chunk.get("usage"), dict):
            self._usage = usage
        if "meridian" in chunk:
            self._trailer = chunk["meridian"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(text, str) and text:
                out += self._delta(text)
            if isinstance(reason := choice.get("finish_reason"), str):
                self._finish = reason
        return bytes(out)

    def _start(self, chunk: dict[str, Any]) -> bytes:
        chat_id = chunk.get("id")
        suffix = _NOT_ID.sub("", chat_id.removeprefix("chatcmpl-")) if isinstance(chat_id, str) else ""
        suffix = suffix or secrets.token_hex(16)
        self._id, self._item_id = f"resp_{suffix}", f"msg_{suffix}"
        created = chunk.get("created")
        self._created = created if isinstance(created, int) else 0
        self._model = str(chunk.get("model") or "")
        response = self._response("in_progress", [], None)
        return (self._event({"type": "response.created", "response": response})
                + self._event({"type": "response.in_progress", "response": response}))

    def _delta(self, text: str) -> bytes:
        out = b""
        if not self._opened:
            self._opened = True
            out = (self._event({"type": "response.output_item.added", "output_index": 0, "item": self._item(
                       "in_progress", [])})
                   + self._event({"type": "response.content_part.added", "output_index": 0, "item_id": self._item_id,
                                  "content_index": 0, "part": _part("", [])}))
        self._text.append(text)
        return out + self._event({"type": "response.output_text.delta", "item_id": self._item_id, "output_index": 0,
                                  "content_index": 0, "delta": text, "logprobs": []})

    def _finished(self) -> bytes:
        self.ended = True
        out = b""
        output: list[dict[str, Any]] = []
        if self._opened:
            text = "".join(self._text)
            part = _part(text, None)  # vLLM's: logprobs None once the part is done
            item = self._item("completed", [part] if text else [])
            out = (self._event({"type": "response.output_text.done", "item_id": self._item_id, "output_index": 0,
                                "content_index": 0, "text": text, "logprobs": []})
                   + self._event({"type": "response.content_part.done", "item_id": self._item_id,
                                  "output_index": 0, "content_index": 0, "part": part})
                   + self._event({"type": "response.output_item.done", "output_index": 0, "item": item}))
            output = [item]
        status = "incomplete" if self._finish == "length" else "completed"
        event: dict[str, Any] = {"type": "response.completed",
                                 "response": self._response(status, output, _usage(self._usage))}
        if self._trailer is not None:
            event["meridian"] = self._trailer
        return out + self._event(event)

    def _error(self, error: Any) -> bytes:
        self.ended = True
        error = error if isinstance(error, dict) else {}
        message = error.get("message")
        return self._event({"type": "error", "code": error.get("code"), "param": error.get("param"),
                            "message": message if isinstance(message, str) else "The answer failed mid-stream."})

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self._item_id, "type": "message", "role": "assistant", "status": status, "content": content,
                "phase": None}

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self._id, "object": "response", "created_at": self._created, "model": self._model,
            "status": status, "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self._echo, "background": False, "previous_response_id": None, "prompt": None, "reasoning": None,
        }

    def _event(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + _ENCODE.encode(event) + b"\n\n"


def _part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Responses API's usage for a chat usage chunk's counts."""
    if chat is None:
        return None
    prompt, completion = chat.get("prompt_tokens") or 0, chat.get("completion_tokens") or 0
    details = chat.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat.get("total_tokens") or prompt + completion}


class ResponsesStream:
    """A CommittedStream (geo_router.forwarding.streaming): the chat stream `inner`, as Responses events."""

    def __init__(self, inner: CommittedStream, echo: dict[str, Any]) -> None:
        self._inner = inner
        self._events = ResponsesEvents(echo)
        self._closed = False
        self.tally = StreamTally()
        self.on_close: list[Callable[[StreamTally], None]] = []

    async def body(self) -> AsyncIterator[bytes]:
        chat = self._inner.body()
        try:
            async for run in chat:
                out = self._events.feed(run)
                if out:
                    self.tally.feed(out)
                    yield out
                if self._events.ended:
                    return
        finally:
            aclose = getattr(chat, "aclose", None)
            if aclose is not None:
                await aclose()

    async def close(self) -> None:
        """Close the chat stream under it (its connection, its node's books); idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._inner.close()
        # Where the chat stream under it moved, for the access line.
        self.tally.moves, self.tally.generated = self._inner.tally.moves, self._inner.tally.generated
        run_close_callbacks(self.on_close, self.tally)
