"""What this router knows about node health and load: passive ejection and in-flight counts.

A node that fails (connect error, timeout, 5xx before the first byte) is ejected, i.e.
skipped by selection, for `ejection_base_s`, doubling with each consecutive failure up to
`ejection_max_s`; one success clears its record. A 4xx is the client's fault, never the
node's. Reads are synchronous on purpose: selection runs on every request, so a shared
implementation (Redis, several routers) keeps a local view and syncs it in the background.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class FleetState(Protocol):
    """Per-node health and load as the router sees it."""

    def is_ejected(self, node_id: str) -> bool: ...

    def ejected_for_s(self, node_id: str) -> float:
        """Seconds until the node is tried again (0 when it is not ejected)."""
        ...

    def record_success(self, node_id: str) -> None: ...

    def record_failure(self, node_id: str) -> float:
        """Count a failure and eject the node; returns the ejection in seconds."""
        ...

    def in_flight(self, node_id: str) -> int: ...

    def begin(self, node_id: str) -> None:
        """A request to the node starts (pair with `end`)."""
        ...

    def end(self, node_id: str) -> None: ...


def ejection_s(consecutive_failures: int, base_s: float, max_s: float) -> float:
    """How long a node is skipped after its `consecutive_failures`-th failure in a row."""
    # Cap the exponent too, so a node that fails for days cannot overflow the float.
    return min(base_s * 2.0 ** min(consecutive_failures - 1, 30), max(max_s, base_s))


@dataclass(slots=True)
class _NodeHealth:
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    in_flight: int = 0


class InProcessFleetState:
    """FleetState held in this process's memory: right for one router."""

    def __init__(
        self,
        ejection_base_s: float,
        ejection_max_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._base_s = ejection_base_s
        self._max_s = max(ejection_max_s, ejection_base_s)
        self._clock = clock
        self._nodes: dict[str, _NodeHealth] = {}

    def is_ejected(self, node_id: str) -> bool:
        return self.ejected_for_s(node_id) > 0

    def ejected_for_s(self, node_id: str) -> float:
        h = self._nodes.get(node_id)
        if h is None:
            return 0.0
        return max(0.0, h.ejected_until - self._clock())

    def record_success(self, node_id: str) -> None:
        h = self._nodes.get(node_id)
        if h is None:
            return
        h.consecutive_failures = 0
        h.ejected_until = 0.0
        self._forget_if_clean(node_id, h)

    def record_failure(self, node_id: str) -> float:
        h = self._nodes.setdefault(node_id, _NodeHealth())
        h.consecutive_failures += 1
        duration = ejection_s(h.consecutive_failures, self._base_s, self._max_s)
        h.ejected_until = self._clock() + duration
        return duration

    def in_flight(self, node_id: str) -> int:
        h = self._nodes.get(node_id)
        return h.in_flight if h else 0

    def begin(self, node_id: str) -> None:
        self._nodes.setdefault(node_id, _NodeHealth()).in_flight += 1

    def end(self, node_id: str) -> None:
        h = self._nodes.get(node_id)
        if h is None:
            return
        h.in_flight = max(0, h.in_flight - 1)
        self._forget_if_clean(node_id, h)

    def _forget_if_clean(self, node_id: str, h: _NodeHealth) -> None:
        # Nodes come and go; keep entries only for nodes with something to remember.
        if h.in_flight == 0 and h.consecutive_failures == 0:
            del self._nodes[node_id]
