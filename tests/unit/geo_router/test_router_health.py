"""Passive ejection: failing nodes are skipped for a while that doubles, and forgiven on success."""

from __future__ import annotations

from geo_router.health import InProcessFleetState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ejection_doubles_per_consecutive_failure_up_to_the_cap():
    clock = Clock()
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=30, clock=clock)
    assert not fleet.is_ejected("n1")
    assert [fleet.record_failure("n1") for _ in range(5)] == [5, 10, 20, 30, 30]
    assert fleet.is_ejected("n1") and fleet.ejected_for_s("n1") == 30
    clock.now += 29.9
    assert fleet.is_ejected("n1")
    clock.now += 0.2
    assert not fleet.is_ejected("n1")
    # Still failing after the ejection ends: the next ejection stays long.
    assert fleet.record_failure("n1") == 30


def test_a_success_resets_the_backoff():
    clock = Clock()
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60, clock=clock)
    fleet.record_failure("n1")
    fleet.record_failure("n1")
    clock.now += 11
    fleet.record_success("n1")
    assert not fleet.is_ejected("n1")
    assert fleet.record_failure("n1") == 5


def test_nodes_are_ejected_independently():
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60, clock=Clock())
    fleet.record_failure("bad")
    assert fleet.is_ejected("bad") and not fleet.is_ejected("good")


def test_in_flight_counts_follow_begin_and_end():
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60)
    fleet.begin("n1")
    fleet.begin("n1")
    fleet.begin("n2")
    assert (fleet.in_flight("n1"), fleet.in_flight("n2"), fleet.in_flight("n3")) == (2, 1, 0)
    fleet.end("n1")
    fleet.end("n1")
    fleet.end("n1")  # an extra end never goes negative
    assert fleet.in_flight("n1") == 0
