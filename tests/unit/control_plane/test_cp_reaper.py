"""Nodes whose heartbeats stop leave the routing table after the TTL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from cp_harness import ControlPlane


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"node_ttl_s": 0.3, "reaper_interval_s": 0.05, "lost_node_retention_s": 0.5, "reaper_grace_s": 0}


async def _wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _statuses(cp: ControlPlane) -> dict[str, str]:
    nodes = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()
    return {n["node_id"]: n["status"] for n in nodes}


async def test_silent_node_is_marked_lost_then_forgotten(cp: ControlPlane) -> None:
    await cp.register("silent", status="ready")
    await cp.register("chatty", status="ready")
    v = await cp.version()

    async def silent_lost() -> bool:
        await cp.heartbeat("chatty")
        return (await _statuses(cp)).get("silent") == "lost"

    await _wait_for(silent_lost)
    table = (await cp.table()).json()
    assert [n["node_id"] for n in table["nodes"]] == ["chatty"]
    assert table["version"] == v + 1

    # A lost node must register again; its heartbeats are refused.
    cp.assert_problem(await cp.heartbeat("silent"), 404)

    async def silent_forgotten() -> bool:
        await cp.heartbeat("chatty")
        return "silent" not in await _statuses(cp)

    await _wait_for(silent_forgotten)
    # Forgetting a node that was already out of the table changes nothing routers see.
    assert await cp.version() == v + 1

    assert (await cp.register("silent", status="ready")).status_code == 200
    table = (await cp.table()).json()
    assert sorted(n["node_id"] for n in table["nodes"]) == ["chatty", "silent"]
    assert table["version"] == v + 2


async def test_long_poll_wakes_when_a_node_expires(cp: ControlPlane) -> None:
    await cp.register("silent", status="ready")
    etag = (await cp.table()).headers["etag"]
    r = await cp.http.get(
        "/v1/routing-table", params={"wait": 4}, headers={**cp.internal, "if-none-match": etag}
    )
    assert r.status_code == 200
    assert r.json()["nodes"] == []


@pytest.mark.parametrize("settings_overrides", [
    {"node_ttl_s": 0.3, "reaper_interval_s": 0.05, "reaper_grace_s": 1.5},
])
async def test_no_node_is_expired_during_the_grace_after_start_up(cp: ControlPlane) -> None:
    """A control plane that was down could not hear heartbeats: silence then is not death."""
    await cp.register("quiet", status="ready")
    await asyncio.sleep(0.8)  # past the TTL, within the grace
    assert (await _statuses(cp))["quiet"] == "ready"

    async def lost() -> bool:
        return (await _statuses(cp))["quiet"] == "lost"

    await _wait_for(lost)
