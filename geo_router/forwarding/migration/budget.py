"""The router's migration budget, in requests and in re-prefilled tokens.

Each migration costs the next node one prefill of the prompt plus everything generated so
far. When a fleet is failing, every stream on it breaks at once; moving them all at the
same instant would pile a burst of long prefills onto the replicas that are left, which is
how one failure becomes two. So, like the retry budget (Envoy's, geo_router.forwarding.outlier),
migrations in flight may be at most a share of the streams in flight (never fewer than a
floor), and the tokens they re-prefill come out of a bucket that refills at a steady rate.

Unlike a retry, a broken stream has a client waiting on it that has already been sent
part of its answer: refusing would throw that away. A migration over the budget therefore
waits its turn (in arrival order) for up to `queue_timeout_s`, and is refused only after
that: a region's worth of broken streams moves in waves instead of failing. A waiter
wakes when a migration ends, a stream begins or the one ahead of it leaves (a slot may be
free), and when the bucket will hold its tokens; all waiting is on the router's clock.
"""

from __future__ import annotations

import asyncio
from collections import deque

from meridian.clock import Clock, event_or_timeout


class MigrationBudget:
    """How many migrations may be in flight, and how many tokens they may re-prefill."""

    def __init__(
        self, clock: Clock, *, percent: float, min_concurrency: int, tokens_per_s: float, burst_tokens: int,
        queue_timeout_s: float = 0.0,
    ) -> None:
        self._clock = clock
        self._percent = percent
        self._min = min_concurrency
        self._rate = tokens_per_s
        self._burst = float(burst_tokens)
        self._tokens = float(burst_tokens)
        self._at = clock.monotonic()
        self._queue_timeout_s = queue_timeout_s
        self._waiting: deque[object] = deque()
        # Set (and replaced) when something that frees a slot happens: a waiter takes the
        # event before it looks, so a change after its look wakes it.
        self._changed = asyncio.Event()
        self.active_streams = 0
        self.active_migrations = 0

    def begin_stream(self) -> None:
        self.active_streams += 1
        self._wake()  # more streams: a larger share may migrate

    def end_stream(self) -> None:
        self.active_streams = max(0, self.active_streams - 1)

    def limit(self) -> int:
        """Migrations that may be in flight now."""
        return max(self._min, int(self.active_streams * self._percent / 100))

    def tokens(self) -> float:
        """Re-prefill tokens available now."""
        now = self._clock.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        return self._tokens

    def try_acquire(self, prefill_tokens: int) -> bool:
        """Start a migration now if the budget allows it (pair a True with `release`)."""
        if self._waiting or self.active_migrations >= self.limit() or self.tokens() < prefill_tokens:
            return False
        self._take(prefill_tokens)
        return True

    async def acquire(self, prefill_tokens: int) -> bool:
        """Start a migration, waiting in line up to the queue timeout; False if refused."""
        if self.try_acquire(prefill_tokens):
            return True
        if prefill_tokens > self._burst or self._queue_timeout_s <= 0:
            return False  # could never fit, or no waiting
        ticket = object()
        self._waiting.append(ticket)
        give_up = self._clock.monotonic() + self._queue_timeout_s
        try:
            while True:
                changed = self._changed
                if self._waiting[0] is ticket and self.active_migrations < self.limit() \
                        and self.tokens() >= prefill_tokens:
                    self._take(prefill_tokens)
                    return True
                left = give_up - self._clock.monotonic()
                if left <= 0:
                    return False
                short = prefill_tokens - self._tokens
                refilled_in = short / self._rate if short > 0 and self._rate > 0 else left
                await event_or_timeout(self._clock, changed, min(left, refilled_in))
        finally:
            self._waiting.remove(ticket)
            self._wake()  # the next in line may go now

    def release(self) -> None:
        """The migration is over (the continuation started, or failed)."""
        self.active_migrations = max(0, self.active_migrations - 1)
        self._wake()

    def _wake(self) -> None:
        if not self._waiting:
            return
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _take(self, prefill_tokens: int) -> None:
        self._tokens -= prefill_tokens
        self.active_migrations += 1
