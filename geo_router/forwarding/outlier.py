"""Envoy's overload guards for the proxy: a per-node circuit breaker and a retry budget.

Both count only this router's own requests: like Envoy's, they protect nodes from this
router, and routers sharing Redis each keep their own.

- `CircuitBreaker`: a node with `max_pending_per_node` requests in flight from this router
  takes no more (Envoy's max_requests per host); the proxy skips it as if it were ejected,
  and answers 503 when every candidate is full. It opens and closes with the in-flight
  count; nothing is timed.
- `RetryBudget`: failover attempts in flight may be at most `budget_percent` of the
  requests in flight, but at least `min_retry_concurrency` (Envoy's retry_budget, 20% and
  3 by default), so that a fleet-wide failure is not doubled by retries while a single
  failing node is still retried around.
"""

from __future__ import annotations

from meridian.settings.router import RouterSettings

from ..state.health import FleetState


class CircuitBreaker:
    """Per-node limit on this router's requests in flight."""

    def __init__(self, fleet: FleetState, max_pending_per_node: int) -> None:
        self._fleet = fleet
        self._max = max_pending_per_node

    @classmethod
    def from_settings(cls, settings: RouterSettings, fleet: FleetState) -> CircuitBreaker:
        return cls(fleet, settings.max_pending_per_node)

    def allows(self, node_id: str) -> bool:
        """Whether one more request may go to the node now."""
        return self._fleet.in_flight(node_id) < self._max


class RetryBudget:
    """How many failover attempts may be in flight, as a share of the requests in flight."""

    def __init__(self, budget_percent: float = 20.0, min_retry_concurrency: int = 3) -> None:
        self._percent = budget_percent
        self._min = min_retry_concurrency
        self.active_requests = 0
        self.active_retries = 0
        self.exhausted = 0  # retries refused, for metrics

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> RetryBudget:
        return cls(settings.retry_budget_percent, settings.min_retry_concurrency)

    def begin_request(self) -> None:
        """A client request starts (pair with `end_request` once its answer is complete)."""
        self.active_requests += 1

    def end_request(self) -> None:
        self.active_requests = max(0, self.active_requests - 1)

    def limit(self) -> int:
        """Retries that may be in flight now."""
        return max(self._min, int(self.active_requests * self._percent / 100))

    def try_acquire(self) -> bool:
        """Start a retry if the budget allows it (pair a True with `release`)."""
        if self.active_retries < self.limit():
            self.active_retries += 1
            return True
        self.exhausted += 1
        return False

    def release(self) -> None:
        """The retry attempt is over (answered or failed)."""
        self.active_retries = max(0, self.active_retries - 1)
