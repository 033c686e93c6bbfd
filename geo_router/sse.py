"""Server-sent events as the router passes them on: whole events only, and what they carried.

A node's stream is forwarded one run of complete events at a time (`SSEFramer`), so a
stream that breaks never leaves half an event at the client, which then gets one
`data: {"error": ...}` event (`error_event`). `StreamTally` counts the events and keeps the
token usage they reported, for rate-limit settlement and metrics; a migrated stream's tally
also says where it moved (`StreamMove`) and how many tokens its nodes generated, for the
access line (geo_router.observability.access_log).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from meridian.contracts import openai_error

_DECODE = msgspec.json.Decoder()
_SEPARATORS = (b"\n\n", b"\r\n\r\n")
_LF_SEPARATOR = (b"\n\n",)


class SSEFramer:
    """Releases only complete SSE events, holding back a trailing partial one."""

    def __init__(self, is_sse: bool) -> None:
        self._is_sse = is_sse
        self._buf = b""
        # Applied to each run of whole events released (the answer's rewrite, if any).
        self.rewrite: Callable[[bytes], bytes] | None = None

    def feed(self, chunk: bytes) -> bytes:
        out = self._feed(chunk)
        return self.rewrite(out) if out and self.rewrite is not None else out

    def _feed(self, chunk: bytes) -> bytes:
        if not self._is_sse:
            return chunk
        # Only the new bytes (and a separator straddling the old tail) can end an event.
        search_from = max(0, len(self._buf) - 3)
        # A CRLF separator only where a CR came (one memchr): rfind walks back through the
        # whole run when there is none, ≈ 80k instructions for a 28 KB run of events.
        crlf = b"\r" in chunk or self._buf.endswith(b"\r")
        self._buf += chunk
        end = 0
        for sep in _SEPARATORS if crlf else _LF_SEPARATOR:
            at = self._buf.rfind(sep, search_from)
            if at >= 0:
                end = max(end, at + len(sep))
        if end == 0:
            return b""
        out, self._buf = self._buf[:end], self._buf[end:]
        return out

    def flush(self) -> bytes:
        out, self._buf = self._buf, b""
        return self.rewrite(out) if out and self.rewrite is not None else out


@dataclass(frozen=True, slots=True)
class StreamMove:
    """A stream that broke on one node and resumed on another (geo_router.forwarding.migration)."""

    node: str  # where it resumed
    region: str
    reason: str  # why it broke (migration.decide.BreakReason)
    tokens_before: int  # tokens generated, on every node so far, when it broke


@dataclass
class StreamTally:
    """What a passed-through SSE stream carried: its JSON data events, and the token counts
    its events reported: an OpenAI usage chunk, the responses API's `response.usage`, or
    Anthropic's `message.usage` then `usage` deltas (merged, later counts winning). A
    migrating stream adds its moves, in order, and the tokens its nodes generated in all."""

    events: int = 0
    usage: dict[str, Any] | None = None
    moves: list[StreamMove] = field(default_factory=list)
    generated: int | None = None

    def feed(self, events: bytes) -> None:
        """Count complete events; parse only those that carry token counts."""
        self.events += events.count(b"data: {")
        if b'"total_tokens"' not in events and b'"output_tokens"' not in events:
            return
        # Anthropic's events carry an `event:` line before their data line.
        for line in events.split(b"\n"):
            if not line.startswith(b"data: {") or b"_tokens" not in line:
                continue
            with contextlib.suppress(msgspec.DecodeError):
                usage = _usage_of(_DECODE.decode(line[6:]))
                if usage is not None:
                    self.usage = {**(self.usage or {}), **usage}


def _usage_of(event: Any) -> dict[str, Any] | None:
    if not isinstance(event, dict):
        return None
    for holder in (event, event.get("response"), event.get("message")):
        if isinstance(holder, dict) and isinstance(usage := holder.get("usage"), dict):
            return usage
    return None


def error_event(message: str, code: str) -> bytes:
    body = openai_error(message, type_="server_error", code=code)
    return b"data: " + json.dumps(body).encode("utf-8") + b"\n\n"


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
