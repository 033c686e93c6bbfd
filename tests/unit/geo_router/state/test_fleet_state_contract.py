"""The FleetState contract, run against every implementation: the in-process one, the one
shared through Redis (a lone router on Redis must behave exactly as one without it) and the
one a router's workers share through a ring (geo_router.workers.host_fleet).

Time is a ManualClock. Redis counts its keys' TTLs in real time, so the Redis variant syncs
right after each change (`settle`), never after the test moved time past an ejection:
Redis would still hold it and hand it back.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from router_harness import router_settings

from geo_router.state.health import Ejection, EjectionPolicy, FailureKind, FleetState, InProcessFleetState
from geo_router.state.redis_fleet import RedisFleetState
from geo_router.workers.host_fleet import HostFleetState, create_ring
from geo_router.workers.host_ring import HostRing
from meridian.clock import ManualClock

ERROR = FailureKind.ERROR
UNREACHABLE = FailureKind.UNREACHABLE
PROBE = FailureKind.PROBE


@dataclass
class Rig:
    fleet: FleetState
    clock: ManualClock
    settle: Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


@pytest.fixture(params=["in-process", "host-ring", pytest.param("redis", marks=pytest.mark.redis)])
async def make_rig(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Callable[..., Rig]]:
    """Makes a fleet state of the parameter's kind (base 5 s, max 60 s unless told)."""
    shared: list[RedisFleetState] = []

    def make(*, base_s: float = 5.0, max_s: float = 60.0, consecutive: int = 5,
             max_percent: float = 50.0) -> Rig:
        clock = ManualClock()
        if request.param == "in-process":
            fleet = InProcessFleetState(base_s, max_s, clock, consecutive_failures_to_eject=consecutive,
                                        max_ejected_percent=max_percent)
            return Rig(fleet, clock, _nothing)
        if request.param == "host-ring":
            ring = tmp_path / f"ring-{uuid.uuid4().hex}"
            create_ring(ring, 64)
            settings = router_settings(ejection_base_s=base_s, ejection_max_s=max_s,
                                       consecutive_failures_to_eject=consecutive, max_ejected_percent=max_percent)
            return Rig(HostFleetState(HostRing(ring), 0, settings, clock), clock, _nothing)
        redis_fleet = RedisFleetState(
            request.getfixturevalue("redis_url"), policy=EjectionPolicy(base_s, max_s, consecutive, max_percent),
            key_prefix=f"meridian-test:{uuid.uuid4().hex}:", timeout_s=1.0, clock=clock,
        )
        shared.append(redis_fleet)

        async def settle() -> None:
            assert await redis_fleet.sync_once()

        return Rig(redis_fleet, clock, settle)

    yield make
    for fleet in shared:
        await fleet.stop()


async def test_an_unreachable_node_is_ejected_at_once_for_longer_each_time(make_rig: Callable[..., Rig]):
    rig = make_rig(max_s=30.0)
    durations = []
    for _ in range(5):
        durations.append(rig.fleet.record_failure("n1", UNREACHABLE))
        await rig.settle()
        assert rig.fleet.is_ejected("n1")
        assert rig.fleet.ejected_for_s("n1") == pytest.approx(durations[-1], abs=0.5)
        rig.clock.advance(durations[-1] + 0.1)
        assert not rig.fleet.is_ejected("n1")
    assert durations == [5, 10, 20, 30, 30]


async def test_errors_eject_only_after_several_in_a_row_and_an_answer_resets_the_count(
    make_rig: Callable[..., Rig],
):
    rig = make_rig(consecutive=3)
    assert [rig.fleet.record_failure("n1", ERROR) for _ in range(2)] == [0, 0]
    rig.fleet.record_success("n1")
    await rig.settle()
    assert [rig.fleet.record_failure("n1", ERROR) for _ in range(2)] == [0, 0]
    assert rig.fleet.record_failure("n1", ERROR) == 5
    await rig.settle()
    assert rig.fleet.is_ejected("n1")
    # Failures of requests sent before the ejection are no new evidence.
    assert rig.fleet.record_failure("n1", UNREACHABLE) == 0
    await rig.settle()
    assert rig.fleet.ejected_for_s("n1") == pytest.approx(5, abs=0.5)


async def test_an_answer_ends_the_ejection_and_the_backoff(make_rig: Callable[..., Rig]):
    rig = make_rig()
    assert rig.fleet.record_failure("n1") == 5
    await rig.settle()
    rig.fleet.record_success("n1")
    await rig.settle()
    assert not rig.fleet.is_ejected("n1") and rig.fleet.ejected_for_s("n1") == 0
    assert rig.fleet.record_failure("n1") == 5  # the backoff starts over


async def test_uneject_ends_the_ejection_but_keeps_the_backoff_level(make_rig: Callable[..., Rig]):
    rig = make_rig()
    assert not rig.fleet.uneject("n1")  # not ejected: nothing to end
    assert rig.fleet.record_failure("n1") == 5
    await rig.settle()
    assert rig.fleet.uneject("n1")
    await rig.settle()
    assert not rig.fleet.is_ejected("n1")
    assert rig.fleet.record_failure("n1") == 10


async def test_a_probe_failing_during_an_ejection_keeps_the_node_out_without_escalating(
    make_rig: Callable[..., Rig],
):
    rig = make_rig()
    heard: list[Ejection] = []
    rig.fleet.add_ejection_listener(heard.append)
    assert rig.fleet.record_failure("n1", PROBE) == 5
    await rig.settle()
    rig.clock.advance(4)
    # A request's failure now was sent before the ejection: no news.
    assert rig.fleet.record_failure("n1", UNREACHABLE) == 0
    # A probe's was sent during it: the node is still down, out for the base time from now.
    assert rig.fleet.record_failure("n1", PROBE) == 5
    await rig.settle()
    rig.clock.advance(4)
    assert rig.fleet.ejected_for_s("n1") == pytest.approx(1, abs=0.5)
    assert [e.node_id for e in heard] == ["n1"]  # one ejection, however long it lasts
    rig.clock.advance(1.5)
    assert not rig.fleet.is_ejected("n1")
    assert rig.fleet.record_failure("n1", PROBE) == 10  # the backoff level was kept, not raised


async def test_the_max_ejected_percent_holds_and_listeners_hear_of_every_ejection(
    make_rig: Callable[..., Rig],
):
    rig = make_rig(max_percent=50.0)
    heard: list[Ejection] = []
    rig.fleet.add_ejection_listener(heard.append)
    rig.fleet.set_known_nodes(["n1", "n2", "n3", "n4"])
    assert rig.fleet.record_failure("n1") == 5
    assert rig.fleet.record_failure("n2") == 5
    await rig.settle()
    assert rig.fleet.record_failure("n3") == 0  # a third of four would exceed half
    await rig.settle()
    assert not rig.fleet.is_ejected("n3")
    assert [(e.node_id, e.enforced) for e in heard] == [("n1", True), ("n2", True), ("n3", False)]
    assert heard[0] == Ejection("n1", UNREACHABLE, 5.0, enforced=True)


async def test_known_nodes_updated_by_a_change_cap_as_if_set_whole(make_rig: Callable[..., Rig]):
    rig = make_rig(max_percent=50.0)
    rig.fleet.set_known_nodes({"n1": ["eu"], "n2": ["eu"], "n3": ["us"], "n4": ["us"]})
    # n2 leaves, n4 moves to the eu zone, n5 joins it: eu is n1, n4, n5; the fleet four nodes.
    rig.fleet.update_known_nodes({"n4": ["eu"], "n5": ["eu"]}, ["n2"])
    assert rig.fleet.record_failure("n1") == 5
    await rig.settle()
    assert rig.fleet.record_failure("n4") == 0  # two of eu's three would exceed half
    assert rig.fleet.record_failure("n3") == 5  # two of the fleet's four do not
    await rig.settle()
    assert rig.fleet.record_failure("n2") == 5  # no longer known: no cap counts it


async def test_in_flight_counts_outlive_a_node_leaving_the_table(make_rig: Callable[..., Rig]):
    rig = make_rig()
    rig.fleet.set_known_nodes({"n1": ["eu"], "n2": []})
    rig.fleet.begin("n1")
    rig.fleet.begin("n1")
    rig.fleet.begin("n2")
    assert rig.fleet.record_failure("n1", ERROR) == 0
    assert (rig.fleet.in_flight("n1"), rig.fleet.in_flight("n2"), rig.fleet.in_flight("n3")) == (2, 1, 0)
    rig.fleet.set_known_nodes(["n2"])
    await rig.settle()
    assert rig.fleet.in_flight("n1") == 2
    rig.fleet.end("n1")
    rig.fleet.end("n1")
    rig.fleet.end("n1")  # one end too many is not a negative count
    assert rig.fleet.in_flight("n1") == 0
    # Its error count went with the table: four more errors do not eject it.
    assert [rig.fleet.record_failure("n1", ERROR) for _ in range(4)] == [0, 0, 0, 0]
