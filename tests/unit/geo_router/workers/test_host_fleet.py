"""Node ejections shared at once by the workers of one router (geo_router.workers.host_fleet):
a node one worker ejected, the others skip; its answer anywhere brings it back everywhere."""

from __future__ import annotations

from pathlib import Path

from router_harness import router_settings

from geo_router.state.health import FailureKind
from geo_router.workers.host_fleet import HostFleetState, create_ring
from geo_router.workers.host_ring import HostRing
from meridian.clock import ManualClock

SETTINGS = router_settings(ejection_base_s=10.0, ejection_max_s=300.0, consecutive_failures_to_eject=3,
                           max_ejected_percent=50.0)


def workers(path: Path, clock: ManualClock, n: int = 2) -> list[HostFleetState]:
    create_ring(path, 64)
    fleets = [HostFleetState(HostRing(path), i, SETTINGS, clock) for i in range(n)]
    for fleet in fleets:
        fleet.set_known_nodes(["eu-1", "eu-2", "eu-3", "eu-4"])
    return fleets


def test_a_node_one_worker_ejects_is_skipped_by_the_other_for_as_long(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "ring", clock)
    assert a.record_failure("eu-1", FailureKind.UNREACHABLE) == 10.0
    assert b.is_ejected("eu-1") and b.ejected_for_s("eu-1") == 10.0
    clock.advance(10.0)
    assert not b.is_ejected("eu-1")
    # The backoff continues at the other worker: its next ejection is twice as long.
    assert b.record_failure("eu-1", FailureKind.UNREACHABLE) == 20.0
    assert a.ejected_for_s("eu-1") == 20.0


def test_an_answer_at_one_worker_forgives_the_node_at_every_worker(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "ring", clock)
    a.record_failure("eu-1", FailureKind.UNREACHABLE)
    clock.advance(10.0)
    a.record_success("eu-1")  # it answers again: its backoff level is gone everywhere
    assert b.record_failure("eu-1", FailureKind.UNREACHABLE) == 10.0


def test_the_probers_early_return_reaches_every_worker(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "ring", clock)
    a.record_failure("eu-1", FailureKind.PROBE)
    assert b.is_ejected("eu-1")
    assert b.uneject("eu-1")
    assert not a.is_ejected("eu-1")


def test_errors_below_the_threshold_stay_with_the_worker_that_saw_them(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "ring", clock)
    for _ in range(2):
        assert a.record_failure("eu-1", FailureKind.ERROR) == 0.0
        assert b.record_failure("eu-1", FailureKind.ERROR) == 0.0
    assert not a.is_ejected("eu-1") and not b.is_ejected("eu-1")


def test_the_cap_counts_the_siblings_ejections(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "ring", clock)
    a.record_failure("eu-1", FailureKind.UNREACHABLE)
    b.record_failure("eu-2", FailureKind.UNREACHABLE)
    # Half of the four nodes are out: a third stays in service, whichever worker sees it fail.
    assert a.record_failure("eu-3", FailureKind.UNREACHABLE) == 0.0
    assert b.record_failure("eu-3", FailureKind.UNREACHABLE) == 0.0
    assert not a.is_ejected("eu-3")
