"""The heartbeat interval grows with the fleet, nodes are told it in every ack, and the reaper
never expires a node that waits the interval it was last told, also while the fleet shrinks.

The control plane runs on a ManualClock (pacing and reaper). Heartbeats are stamped by the
database's clock, which no test can move: a node that waits out an interval is one whose
last heartbeat is set back in the database by that much.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from cp_harness import LOOPS_OFF, REAPER, ControlPlane, advance, until

from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node
from control_plane.heartbeat_pacing import REFRESH_S, HeartbeatPacer, PacingPolicy
from meridian.clock import ManualClock

REAPER_INTERVAL_S = 0.05
# 1 s and a 5 s TTL while the fleet is small; one heartbeat a second in all: 20 nodes are told 20 s.
PACING = {"heartbeat_interval_s": 1.0, "node_ttl_s": 5.0, "max_heartbeats_per_s": 1.0}


@pytest.fixture
def clock_kind() -> str:
    return "manual"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {**PACING, "reaper_interval_s": REAPER_INTERVAL_S, "reaper_grace_s": 0, **LOOPS_OFF}


def _silent_for(cp: ControlPlane, node_id: str, seconds: float) -> None:
    """Set the node's last heartbeat `seconds` back by the database's clock."""
    ctx: AppContext = cp.app.state.ctx
    with ctx.write() as session:
        node = session.get(Node, node_id)
        assert node is not None
        node.last_heartbeat = db_now(session) - timedelta(seconds=seconds)


async def _status(cp: ControlPlane, node_id: str) -> str:
    status: str = (await cp.http.get(f"/v1/nodes/{node_id}", headers=cp.admin)).json()["status"]
    return status


async def _beat(cp: ControlPlane, node_id: str) -> float:
    """One heartbeat; the interval the ack tells the node."""
    r = await cp.heartbeat(node_id, models=["tiny-llama"])
    assert r.status_code == 200, r.text
    interval: float = r.json()["heartbeat_interval_s"]
    return interval


async def test_the_interval_grows_with_the_fleet_and_the_ack_carries_it(cp: ControlPlane, clock: ManualClock) -> None:
    r = await cp.register("n00", status="ready")
    # Registration tells the configured interval: an older node keeps it for good.
    assert r.json()["heartbeat_interval_s"] == 1.0
    assert await _beat(cp, "n00") == 1.0

    for i in range(1, 20):
        await cp.register(f"n{i:02}", status="ready")
    assert await _beat(cp, "n00") == 1.0  # the fleet's size is re-read every REFRESH_S
    # Moved on with the reaper asleep and waited for until its pass ends: the pass re-reads the
    # count too, and a heartbeat that comes while it does goes on with the old one (a request
    # never waits for the count), which is what CI saw on Postgres.
    await until(lambda: clock.sleepers >= REAPER)
    await advance(clock, REFRESH_S, sleepers=REAPER)
    assert await _beat(cp, "n00") == 20.0


async def test_the_reaper_spares_a_node_that_follows_its_interval_while_the_fleet_shrinks(
    cp: ControlPlane, clock: ManualClock
) -> None:
    for i in range(20):
        await cp.register(f"n{i:02}", status="ready")
    await until(lambda: clock.sleepers >= REAPER)
    await advance(clock, REFRESH_S, sleepers=REAPER)
    assert await _beat(cp, "n00") == 20.0  # told: next heartbeat in 20 s

    # The rest of the fleet leaves; the interval handed out falls back to 1 s at once.
    for i in range(1, 20):
        assert (await cp.http.delete(f"/v1/nodes/n{i:02}", headers=cp.internal)).status_code == 204
    await advance(clock, REFRESH_S, sleepers=REAPER)
    assert cp.app.state.ctx.pacer.interval_s() == 1.0

    # n00 waits the 20 s it was told (and a little): far past the 5 s TTL of a 1 s interval.
    _silent_for(cp, "n00", 21)
    await advance(clock, REAPER_INTERVAL_S, sleepers=REAPER)
    assert await _status(cp, "n00") == "ready"

    # Its next heartbeat tells it 1 s; once the 20 s interval's TTL (100 s) has passed since it
    # was last handed out, the reaper holds it to 5 s again.
    assert await _beat(cp, "n00") == 1.0
    await advance(clock, 100 + REFRESH_S, sleepers=REAPER)
    _silent_for(cp, "n00", 6)
    await advance(clock, REAPER_INTERVAL_S, sleepers=REAPER)
    assert await _status(cp, "n00") == "lost"


def test_the_reapers_ttl_follows_a_growing_fleet_at_once_and_a_shrinking_one_after_the_hold() -> None:
    clock = ManualClock()
    pacer = HeartbeatPacer(PacingPolicy(base_interval_s=2.0, base_ttl_s=10.0, max_heartbeats_per_s=500.0), clock)
    pacer.observe(100)
    assert (pacer.interval_s(), pacer.reaper_ttl_s()) == (2.0, 10.0)
    pacer.observe(10_000)
    assert (pacer.interval_s(), pacer.reaper_ttl_s()) == (20.0, 100.0)

    clock.advance(30)
    pacer.observe(5_000)  # 10 s from now on; 20 s was handed out until now
    assert pacer.interval_s() == 10.0
    clock.advance(100 + REFRESH_S - 1)
    assert pacer.reaper_ttl_s() == 100.0
    clock.advance(2)
    assert pacer.reaper_ttl_s() == 50.0


def test_without_a_rate_the_configured_interval_stands() -> None:
    policy = PacingPolicy(base_interval_s=2.0, base_ttl_s=10.0, max_heartbeats_per_s=None)
    assert policy.interval_s(1_000_000) == 2.0
    assert policy.ttl_s(policy.interval_s(1_000_000)) == 10.0
