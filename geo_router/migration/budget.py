"""The router's migration budget, in requests and in re-prefilled tokens.

Each migration costs the next node one prefill of the prompt plus everything generated so
far. When a fleet is failing, every stream on it breaks at once; moving them all would pile
a burst of long prefills onto the replicas that are left, which is how one failure becomes
two. Like the retry budget (Envoy's, geo_router.outlier), migrations in flight may be at
most a share of the streams in flight (never fewer than a floor), and the tokens they
re-prefill come out of a bucket that refills at a steady rate.
"""

from __future__ import annotations

from meridian.clock import Clock


class MigrationBudget:
    """How many migrations may be in flight, and how many tokens they may re-prefill."""

    def __init__(
        self, clock: Clock, *, percent: float, min_concurrency: int, tokens_per_s: float, burst_tokens: int
    ) -> None:
        self._clock = clock
        self._percent = percent
        self._min = min_concurrency
        self._rate = tokens_per_s
        self._burst = float(burst_tokens)
        self._tokens = float(burst_tokens)
        self._at = clock.monotonic()
        self.active_streams = 0
        self.active_migrations = 0

    def begin_stream(self) -> None:
        self.active_streams += 1

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
        """Start a migration that re-prefills `prefill_tokens` (pair a True with `release`)."""
        if self.active_migrations >= self.limit() or self.tokens() < prefill_tokens:
            return False
        self._tokens -= prefill_tokens
        self.active_migrations += 1
        return True

    def release(self) -> None:
        """The migration is over (the continuation started, or failed)."""
        self.active_migrations = max(0, self.active_migrations - 1)
