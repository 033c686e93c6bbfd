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

from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node
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
