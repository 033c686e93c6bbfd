"""Exponential backoff with jitter, the one retry schedule every Meridian client uses."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delay before retry n (n >= 1): base * 2**(n-1), capped at max_s, then jittered.

    `full` jitter draws uniformly from [0, delay] (AWS's advice for many clients
    retrying one server); otherwise the delay is scaled by [1 - jitter, 1 + jitter].
    """

    base_s: float
    max_s: float
    jitter: float = 0.2
    full: bool = False

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        capped = min(self.max_s, self.base_s * 2 ** max(0, attempt - 1))
        if self.full:
            return capped * rand()
        return capped * (1.0 - self.jitter + 2.0 * self.jitter * rand())
