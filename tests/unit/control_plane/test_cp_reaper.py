"""Nodes whose heartbeats stop leave the routing table after the TTL.

The app runs on a ManualClock, so the reaper passes when the test moves it. Heartbeats are
stamped by the database's clock (control_plane.db.clock), which no test can move: a node
falls silent here by having its last heartbeat set back in the database.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from cp_harness import LOOPS_OFF, REAPER, ControlPlane, advance, until
from prometheus_client.parser import text_string_to_metric_families

from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node
from control_plane.reaper import reap_once
from meridian.clock import ManualClock

INTERVAL_S = 0.05


@pytest.fixture
def clock_kind() -> str:
    return "manual"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"node_ttl_s": 5.0, "reaper_interval_s": INTERVAL_S, "lost_node_retention_s": 5.0, "reaper_grace_s": 0,
            **LOOPS_OFF}


def _silent_for(cp: ControlPlane, node_id: str, seconds: float) -> None:
    """Set the node's last heartbeat `seconds` back by the database's clock."""
    ctx: AppContext = cp.app.state.ctx
    with ctx.write() as session:
        node = session.get(Node, node_id)
        assert node is not None
        node.last_heartbeat = db_now(session) - timedelta(seconds=seconds)


async def _reap(clock: ManualClock) -> None:
    """One reaper pass."""
    await until(lambda: clock.sleepers >= REAPER)
    await advance(clock, INTERVAL_S, sleepers=REAPER)


async def _statuses(cp: ControlPlane) -> dict[str, str]:
    nodes = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()
    return {n["node_id"]: n["status"] for n in nodes}


async def test_silent_node_is_marked_lost_then_forgotten(cp: ControlPlane, clock: ManualClock) -> None:
    await cp.register("silent", status="ready")
    await cp.register("chatty", status="ready")
    v = await cp.version()

    _silent_for(cp, "silent", cp.settings.node_ttl_s + 1)  # past the TTL, within the retention
    await cp.heartbeat("chatty")
    await _reap(clock)
    assert (await _statuses(cp)).get("silent") == "lost"
    table = (await cp.table()).json()
    assert [n["node_id"] for n in table["nodes"]] == ["chatty"]
    assert table["version"] == v + 1

    # A lost node must register again; its heartbeats are refused.
    cp.assert_problem(await cp.heartbeat("silent"), 404)

    _silent_for(cp, "silent", cp.settings.node_ttl_s + cp.settings.lost_node_retention_s + 1)
    await cp.heartbeat("chatty")
    await _reap(clock)
    assert "silent" not in await _statuses(cp)
    # Forgetting a node that was already out of the table changes nothing routers see.
    assert await cp.version() == v + 1

    assert (await cp.register("silent", status="ready")).status_code == 200
    table = (await cp.table()).json()
    assert sorted(n["node_id"] for n in table["nodes"]) == ["chatty", "silent"]
    assert table["version"] == v + 2


async def test_long_poll_wakes_when_a_node_expires(cp: ControlPlane, clock: ManualClock) -> None:
    await cp.register("silent", status="ready")
    etag = (await cp.table()).headers["etag"]
    poll = asyncio.create_task(cp.http.get(
        "/v1/routing-table", params={"wait": 4}, headers={**cp.internal, "if-none-match": etag}
    ))
    await until(lambda: clock.sleepers >= REAPER + 1)  # the poll waits
    _silent_for(cp, "silent", cp.settings.node_ttl_s + 1)
    clock.advance(INTERVAL_S)  # a reaper pass, well inside the poll's wait
    r = await asyncio.wait_for(poll, 10)
    assert r.status_code == 200
    assert r.json()["nodes"] == []


@pytest.mark.parametrize("settings_overrides", [
    {"node_ttl_s": 0.3, "reaper_interval_s": INTERVAL_S, "reaper_grace_s": 1.5, **LOOPS_OFF},
])
async def test_no_node_is_expired_during_the_grace_after_start_up(cp: ControlPlane, clock: ManualClock) -> None:
    """A control plane that was down could not hear heartbeats: silence then is not death."""
    await cp.register("quiet", status="ready")
    _silent_for(cp, "quiet", 10)  # past the TTL
    await until(lambda: clock.sleepers >= REAPER)
    for _ in range(16):  # 0.8 s of reaper passes, within the grace
        await advance(clock, INTERVAL_S, sleepers=REAPER)
    assert (await _statuses(cp))["quiet"] == "ready"

    for _ in range(16):  # past the grace: the next pass expires it
        await advance(clock, INTERVAL_S, sleepers=REAPER)
    assert (await _statuses(cp))["quiet"] == "lost"


# --- static stability: the control plane's own lag never reaps a healthy fleet -------------

STABLE = {"node_ttl_s": 5.0, "reaper_interval_s": INTERVAL_S, "reaper_grace_s": 0, **LOOPS_OFF}


async def _fresh(cp: ControlPlane, *node_ids: str) -> None:
    for node_id in node_ids:
        assert (await cp.heartbeat(node_id)).status_code == 200


async def _metric(cp: ControlPlane, name: str, **labels: str) -> float:
    """One sample of the control plane's /metrics."""
    text = (await cp.http.get("/metrics", headers=cp.admin)).text
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.mark.parametrize("settings_overrides", [{**STABLE, "reaper_grace_s": 1.0, "reaper_stall_s": 0.5}])
async def test_a_late_pass_expires_nobody_and_restarts_the_grace(cp: ControlPlane, clock: ManualClock) -> None:
    """A control plane that was paused heard no heartbeat: the silence then is its own."""
    await cp.register("quiet", status="ready")
    await until(lambda: clock.sleepers >= REAPER)
    for _ in range(25):  # past the start-up grace
        await advance(clock, INTERVAL_S, sleepers=REAPER)
    _silent_for(cp, "quiet", cp.settings.node_ttl_s + 1)  # what a pause of the TTL and more leaves

    await advance(clock, 3.0, sleepers=REAPER)  # one pass, 3 s late: the loop was paused
    assert (await _statuses(cp))["quiet"] == "ready"
    assert await _metric(cp, "meridian_cp_reaper_passes_total", kind="grace") >= 1
    for _ in range(18):  # 0.9 s of passes, within the grace that restarted at the late pass
        await advance(clock, INTERVAL_S, sleepers=REAPER)
    assert (await _statuses(cp))["quiet"] == "ready"

    for _ in range(4):  # the grace over: a node still silent is expired
        await advance(clock, INTERVAL_S, sleepers=REAPER)
    assert (await _statuses(cp))["quiet"] == "lost"


@pytest.mark.parametrize("settings_overrides", [STABLE])
async def test_a_pass_whose_database_read_comes_late_expires_nobody(cp: ControlPlane, clock: ManualClock) -> None:
    """Paused between its wake-up and its read of the database's clock, the pass does nothing."""
    await cp.register("quiet", status="ready")
    _silent_for(cp, "quiet", cp.settings.node_ttl_s + 1)
    ctx: AppContext = cp.app.state.ctx
    result = reap_once(ctx, read_by=clock.monotonic() - 0.001)
    assert result.stalled and result.lost == ()
    assert (await _statuses(cp))["quiet"] == "ready"
    assert reap_once(ctx, read_by=clock.monotonic()).lost == ("quiet",)


@pytest.mark.parametrize("settings_overrides", [STABLE])
async def test_fleet_wide_silence_holds_and_shows_in_the_metric(cp: ControlPlane, clock: ManualClock) -> None:
    nodes = [f"n{i}" for i in range(4)]
    for n in nodes:
        await cp.register(n, status="ready")
    v = await cp.version()

    # Nobody's heartbeat recorded for longer than the TTL: the control plane is behind.
    for n in nodes:
        _silent_for(cp, n, cp.settings.node_ttl_s + 1)
    await _reap(clock)
    assert set((await _statuses(cp)).values()) == {"ready"}
    assert await _metric(cp, "meridian_cp_reaper_holding", reason="heartbeats_behind") == 1
    assert await _metric(cp, "meridian_cp_reaper_deferred_nodes") == 4

    # Some heartbeats get through, most do not (an overloaded control plane): still held.
    await _fresh(cp, "n0")
    await _reap(clock)
    assert set((await _statuses(cp)).values()) == {"ready"}
    assert await _metric(cp, "meridian_cp_reaper_holding", reason="fleet_silent") == 1
    assert await _metric(cp, "meridian_cp_reaper_holding", reason="heartbeats_behind") == 0
    assert await cp.version() == v

    # Caught up: the hold ends, and a node that stays silent now is a node's own silence.
    await _fresh(cp, "n0", "n1", "n2")
    await _reap(clock)
    assert await _metric(cp, "meridian_cp_reaper_holding", reason="fleet_silent") == 0
    assert (await _statuses(cp))["n3"] == "lost"


@pytest.mark.parametrize("settings_overrides", [STABLE])
async def test_one_regions_mass_silence_is_expired_at_most_a_fifth_per_pass(cp: ControlPlane,
                                                                           clock: ManualClock) -> None:
    """A region gone silent leaves the table over five passes, never a larger share at once."""
    east = [f"east-{i}" for i in range(10)]
    west = [f"west-{i}" for i in range(10)]
    for n in east:
        await cp.register(n, region="aws:us-east-1", status="ready")
    for n in west:
        await cp.register(n, region="gcp:europe-west4", status="ready")
    for i, n in enumerate(east):  # east-0 silent longest
        _silent_for(cp, n, cp.settings.node_ttl_s + 10 - i * 0.1)
    lost_per_pass = []
    for _ in range(6):
        await _fresh(cp, *west)
        await _reap(clock)
        statuses = await _statuses(cp)
        lost_per_pass.append(sorted(n for n, s in statuses.items() if s == "lost"))
    assert [len(lost) for lost in lost_per_pass] == [2, 4, 6, 8, 10, 10]
    assert lost_per_pass[0] == ["east-0", "east-1"]  # longest silent first
    assert all(statuses[n] == "ready" for n in west)


@pytest.mark.parametrize("settings_overrides", [STABLE])
async def test_a_single_dead_node_among_live_ones_is_expired_within_ttl_plus_an_interval(
    cp: ControlPlane, clock: ManualClock
) -> None:
    """The guarantee static stability must not cost: one node's death is seen at once."""
    live = [f"live-{i}" for i in range(4)]
    for n in [*live, "dead"]:
        await cp.register(n, status="ready")
    ttl = cp.settings.node_ttl_s
    _silent_for(cp, "dead", ttl - 0.5)  # not yet the TTL
    await _fresh(cp, *live)
    await _reap(clock)
    assert (await _statuses(cp))["dead"] == "ready"

    _silent_for(cp, "dead", ttl + INTERVAL_S)  # the TTL passed within the last interval
    await _fresh(cp, *live)
    await _reap(clock)  # the next pass
    statuses = await _statuses(cp)
    assert statuses["dead"] == "lost"
    assert all(statuses[n] == "ready" for n in live)
    assert "dead" not in {n["node_id"] for n in (await cp.table()).json()["nodes"]}
