"""Circuit breaker and retry budget: overload guards that count this router's own requests."""

from __future__ import annotations

from router_harness import router_settings

from geo_router.forwarding.outlier import CircuitBreaker, RetryBudget
from geo_router.state.health import InProcessFleetState


def test_the_breaker_turns_a_node_away_at_its_pending_limit_and_lets_it_in_again():
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60)
    breaker = CircuitBreaker(fleet, max_pending_per_node=2)
    fleet.begin("n1")
    assert breaker.allows("n1")
    fleet.begin("n1")
    assert not breaker.allows("n1")
    assert breaker.allows("n2")  # per node
    fleet.end("n1")
    assert breaker.allows("n1")


def test_the_breaker_takes_its_limit_from_settings():
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60)
    breaker = CircuitBreaker.from_settings(router_settings(max_pending_per_node=1), fleet)
    assert breaker.allows("n1")
    fleet.begin("n1")
    assert not breaker.allows("n1")


def test_with_little_traffic_the_minimum_retry_concurrency_applies():
    budget = RetryBudget(budget_percent=20, min_retry_concurrency=3)
    budget.begin_request()
    assert [budget.try_acquire() for _ in range(4)] == [True, True, True, False]
    assert budget.exhausted == 1
    budget.release()
    assert budget.try_acquire()


def test_retries_in_flight_are_bounded_by_a_share_of_requests_in_flight():
    budget = RetryBudget(budget_percent=20, min_retry_concurrency=3)
    for _ in range(100):
        budget.begin_request()
    granted = sum(budget.try_acquire() for _ in range(50))
    assert granted == 20 and budget.active_retries == 20
    # Requests finishing shrink the budget: no new retry until retries fall below it.
    for _ in range(50):
        budget.end_request()
    assert budget.limit() == 10
    assert not budget.try_acquire()
    for _ in range(11):
        budget.release()
    assert budget.active_retries == 9
    assert budget.try_acquire()
    assert not budget.try_acquire()


def test_a_zero_budget_without_a_minimum_allows_no_retry_and_counts_never_go_negative():
    budget = RetryBudget(budget_percent=0, min_retry_concurrency=0)
    budget.begin_request()
    assert not budget.try_acquire()
    budget.release()
    budget.end_request()
    budget.end_request()
    assert (budget.active_requests, budget.active_retries) == (0, 0)


def test_the_budget_takes_its_shape_from_settings():
    budget = RetryBudget.from_settings(router_settings(retry_budget_percent=50, min_retry_concurrency=1))
    for _ in range(10):
        budget.begin_request()
    assert sum(budget.try_acquire() for _ in range(10)) == 5
