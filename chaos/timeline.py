"""A drill run's clock and event log: what the schedule, every environment and every fault
injector share.

It is a leaf (it imports nothing of chaos), so that the environments, the injectors that
act on them and the schedule that drives both can all depend on it without depending on
each other. Times are seconds from the load's start on `time.monotonic()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultEvent:
    """What the injector actually did, in seconds from the start of the load."""

    at_s: float
    action: str  # e.g. "inject", "heal", "abort"
    detail: str  # e.g. "SIGKILL node-aws-us-east-1-2 (pid 1234)"


@dataclass(kw_only=True)
class Timeline:
    """The run's clock and event log; times are seconds from the load's start. Environments
    (a local fabric's, a deployment's) extend it with what their injectors act on."""

    clock_start: float = 0.0
    events: list[FaultEvent] = field(default_factory=list)
    # Told of each event as it is recorded (`meridian chaos run` shows them: chaos.progress).
    on_event: Callable[[FaultEvent], None] | None = field(default=None, repr=False, compare=False)

    def now_s(self) -> float:
        return time.monotonic() - self.clock_start

    def event(self, action: str, detail: str) -> None:
        """Record what an injector did, for the report's timeline."""
        at = round(self.now_s(), 3)
        recorded = FaultEvent(at_s=at, action=action, detail=detail)
        self.events.append(recorded)
        log.info("%.2fs %s: %s", at, action, detail)
        if self.on_event is not None:
            self.on_event(recorded)
