"""Stop-string detection over streamed text, holding back only what could still
turn out to be the start of a stop string.

One matcher for the engine (a generation's own stops) and the router (stops that span the
seam of a migrated stream), so both decide a stop the same way."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas; get back the part that is safe to send to the client."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text to emit, whether a stop string was reached). After a match the
        stop string and anything after it are dropped, as OpenAI does."""
        if not self._stops:
            return text, False
        self._pending += text
        first: tuple[int, str] | None = None
        for stop in self._stops:
            idx = self._pending.find(stop)
            if idx >= 0 and (first is None or idx < first[0]):
                first = (idx, stop)
        if first is not None:
            emit = self._pending[: first[0]]
            self._pending = ""
            self.matched = first[1]
            return emit, True
        hold = self._held_suffix_len()
        emit = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return emit, False

    def flush(self) -> str:
        """The held-back tail, once the sequence ends for another reason."""
        rest, self._pending = self._pending, ""
        return rest

    def _held_suffix_len(self) -> int:
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:k]):
                    best = k
                    break
        return best
