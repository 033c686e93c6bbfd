"""Passive outlier detection: who gets ejected, for how long, and never too many at once."""

from __future__ import annotations

import logging

import pytest

from geo_router.state.health import Ejection, FailureKind, InProcessFleetState
from meridian.clock import ManualClock

ERROR = FailureKind.ERROR


def make_fleet(clock: ManualClock | None = None, *, base_s: float = 5, max_s: float = 60,
               consecutive: int = 5, max_percent: float = 50) -> InProcessFleetState:
    return InProcessFleetState(ejection_base_s=base_s, ejection_max_s=max_s, clock=clock or ManualClock(),
                               consecutive_failures_to_eject=consecutive,
                               max_ejected_percent=max_percent)


def test_an_unreachable_node_is_ejected_at_once_for_longer_each_time_up_to_the_cap():
    clock = ManualClock()
    fleet = make_fleet(clock, max_s=30)
    assert not fleet.is_ejected("n1")
    durations = []
    for _ in range(5):
        durations.append(fleet.record_failure("n1", FailureKind.UNREACHABLE))
        assert fleet.is_ejected("n1")
        clock.advance(durations[-1] + 0.1)  # the ejection ends; the node still fails
    assert durations == [5, 10, 20, 30, 30]


def test_failures_while_ejected_neither_extend_nor_escalate_the_ejection():
    # Requests sent before the ejection fail after it: that is no new evidence.
    clock = ManualClock()
    fleet = make_fleet(clock)
    assert fleet.record_failure("n1") == 5
    clock.advance(2)
    assert [fleet.record_failure("n1") for _ in range(3)] == [0, 0, 0]
    assert fleet.ejected_for_s("n1") == pytest.approx(3)
    clock.advance(3.1)
    assert fleet.record_failure("n1") == 10  # the next ejection continues the backoff


def test_errors_eject_only_after_n_in_a_row():
    fleet = make_fleet(consecutive=3)
    assert [fleet.record_failure("n1", ERROR) for _ in range(2)] == [0, 0]
    assert not fleet.is_ejected("n1")
    assert fleet.record_failure("n1", ERROR) == 5
    assert fleet.is_ejected("n1")


def test_an_answered_request_resets_the_error_count():
    fleet = make_fleet(consecutive=3)
    fleet.record_failure("n1", ERROR)
    fleet.record_failure("n1", ERROR)
    fleet.record_success("n1")
    fleet.record_failure("n1", ERROR)
    fleet.record_failure("n1", ERROR)
    assert not fleet.is_ejected("n1")


def test_after_an_ejection_ends_errors_count_from_zero_again():
    clock = ManualClock()
    fleet = make_fleet(clock, consecutive=2)
    fleet.record_failure("n1", ERROR)
    assert fleet.record_failure("n1", ERROR) == 5
    clock.advance(6)
    assert fleet.record_failure("n1", ERROR) == 0
    assert fleet.record_failure("n1", ERROR) == 10


def test_a_success_resets_the_backoff():
    clock = ManualClock()
    fleet = make_fleet(clock)
    fleet.record_failure("n1")
    clock.advance(6)
    fleet.record_failure("n1")
    clock.advance(11)
    fleet.record_success("n1")
    assert not fleet.is_ejected("n1")
    assert fleet.record_failure("n1") == 5


def test_uneject_ends_the_ejection_early_but_keeps_the_backoff():
    clock = ManualClock()
    fleet = make_fleet(clock)
    assert not fleet.uneject("n1")
    fleet.record_failure("n1")
    assert fleet.uneject("n1")
    assert not fleet.is_ejected("n1")
    assert not fleet.uneject("n1")
    # Answering probes is not answering requests: failing again ejects for longer.
    assert fleet.record_failure("n1") == 10


def test_nodes_are_ejected_independently():
    fleet = make_fleet()
    fleet.record_failure("bad")
    assert fleet.is_ejected("bad") and not fleet.is_ejected("good")


def test_no_more_than_the_max_ejected_percent_of_known_nodes_is_ejected(
    caplog: pytest.LogCaptureFixture,
):
    clock = ManualClock()
    fleet = make_fleet(clock, max_percent=50)
    events: list[Ejection] = []
    fleet.add_ejection_listener(events.append)
    fleet.set_known_nodes(["a", "b", "c", "d"])
    caplog.set_level(logging.WARNING, logger="geo_router.state.health")
    assert fleet.record_failure("a") == 5
    assert fleet.record_failure("b") == 5
    # A third would take 75% out: counted, logged, not enforced.
    assert fleet.record_failure("c") == 0
    assert not fleet.is_ejected("c")
    assert "max_ejected_percent" in caplog.text
    assert events[-1] == Ejection("c", FailureKind.UNREACHABLE, 0.0, enforced=False)
    assert [e.node_id for e in events if e.enforced] == ["a", "b"]
    # Once one ejection ends, the counted node goes at its next failure.
    clock.advance(5.1)
    fleet.record_success("a")
    assert fleet.record_failure("c") == 5


def test_the_cap_also_holds_within_each_zone():
    """Issue 18: with the cap over all nodes, a two-node zone could be ejected whole while its
    zoned tenants had nowhere else to go."""
    fleet = make_fleet(max_percent=50)
    fleet.set_known_nodes({"eu-1": ["eu"], "eu-2": ["eu"], **{f"us-{i}": ["us"] for i in range(8)}})
    assert fleet.record_failure("eu-1") == 5
    # 2 of 10 nodes would be fine fleet-wide, but not 2 of the eu zone's 2.
    assert fleet.record_failure("eu-2") == 0 and not fleet.is_ejected("eu-2")
    # Other zones have their own share.
    assert fleet.record_failure("us-0") == 5
    assert fleet.record_failure("us-1") == 5


def test_the_cap_never_stops_the_first_ejection():
    fleet = make_fleet(max_percent=10)
    fleet.set_known_nodes(["a", "b", "c"])
    assert fleet.record_failure("a") == 5
    assert fleet.record_failure("b") == 0


def test_nodes_outside_the_table_are_neither_capped_nor_counted():
    fleet = make_fleet(max_percent=50)
    fleet.set_known_nodes(["a", "b"])
    assert fleet.record_failure("gone-1") == 5
    assert fleet.record_failure("a") == 5
    assert fleet.record_failure("gone-2") == 5
    assert fleet.record_failure("b") == 0


def test_a_node_that_leaves_the_table_is_forgotten():
    fleet = make_fleet()
    fleet.set_known_nodes(["a", "b"])
    fleet.record_failure("a")
    fleet.set_known_nodes(["b"])
    assert not fleet.is_ejected("a")
    fleet.set_known_nodes(["a", "b"])
    assert fleet.record_failure("a") == 5  # back with a clean record


def test_a_broken_listener_does_not_stop_ejection():
    fleet = make_fleet()

    def broken(_: Ejection) -> None:
        raise RuntimeError("metrics exploded")

    fleet.add_ejection_listener(broken)
    assert fleet.record_failure("n1") == 5
    assert fleet.is_ejected("n1")


def test_in_flight_counts_follow_begin_and_end():
    fleet = make_fleet()
    fleet.begin("n1")
    fleet.begin("n1")
    fleet.begin("n2")
    assert (fleet.in_flight("n1"), fleet.in_flight("n2"), fleet.in_flight("n3")) == (2, 1, 0)
    fleet.end("n1")
    fleet.end("n1")
    fleet.end("n1")  # an extra end never goes negative
    assert fleet.in_flight("n1") == 0


def test_in_flight_survives_the_node_leaving_the_table():
    fleet = make_fleet()
    fleet.begin("n1")
    fleet.set_known_nodes([])
    assert fleet.in_flight("n1") == 1
    fleet.end("n1")
    assert fleet.in_flight("n1") == 0
