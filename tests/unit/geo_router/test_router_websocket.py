"""The Responses WebSocket on a real router (its production listener) in front of stand-in
nodes: residency from the key, the pipeline's errors as `error` events, the client leaving
mid-turn, and the connection's idle and age limits on the router's clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import websockets
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    NodeBehaviour,
    ServerGroup,
    eventually,
    make_table,
    node,
    node_app,
    router_settings,
    serve_router,
)

from geo_router import create_app
from geo_router.table import StaticTableSource
from meridian.clock import ManualClock
from meridian.contracts import TenantEntry
from meridian.security import hash_api_key

CREATE = {"type": "response.create", "model": MODEL, "input": "hi", "store": False}
LIMITED = "mrd_one-request-a-minute"


@dataclass
class SocketRig:
    url: str
    behaviours: dict[str, NodeBehaviour]
    node_urls: dict[str, str]
    source: StaticTableSource
    clock: ManualClock

    def connect(self, key: str = GLOBAL_KEY) -> Any:
        return websockets.connect(self.url, additional_headers={"authorization": f"Bearer {key}"})


@pytest.fixture
async def rig() -> AsyncIterator[SocketRig]:
    servers = ServerGroup()
    behaviours = {name: NodeBehaviour(name) for name in ("us", "eu")}
    clock = ManualClock()
    try:
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        table = make_table([node(n, u) for n, u in urls.items()])
        table.tenants.append(TenantEntry(key_hash=hash_api_key(LIMITED), key_prefix=LIMITED[:10], tenant="slow",
                                         zone="global", requests_per_minute=1))
        source = StaticTableSource(table)
        settings = router_settings(ws_idle_timeout_s=30.0, ws_max_connection_s=100.0)
        app = create_app(settings, table_source=source, clock=clock)
        url = (await serve_router(servers, app, settings)).replace("http://", "ws://") + "/v1/responses"
        yield SocketRig(url, behaviours, urls, source, clock)
    finally:
        for b in behaviours.values():
            b.release.set()
        await servers.stop()


async def _until_final(ws: Any) -> list[dict[str, Any]]:
    events = []
    while not events or events[-1]["type"] not in ("response.completed", "error"):
        events.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
    return events


async def test_an_eu_key_is_served_in_eu_only(rig: SocketRig) -> None:
    async with rig.connect(EU_KEY) as ws:
        await ws.send(json.dumps(CREATE))
        events = await _until_final(ws)
        assert events[-1]["type"] == "response.completed"
        assert rig.behaviours["eu"].hits == 1 and rig.behaviours["us"].hits == 0
        # With no replica in its zone, the turn is refused, never sent elsewhere.
        rig.source.set(make_table([node("us", rig.node_urls["us"])], version=2))
        await ws.send(json.dumps(CREATE))
        refused = await _until_final(ws)
    assert refused[-1]["status"] == 503 and refused[-1]["error"]["code"] == "no_replica_in_zone"
    assert "retry-after" in refused[-1]["error"]["headers"]
    assert rig.behaviours["us"].hits == 0


async def test_a_client_leaving_mid_turn_ends_the_node_request(rig: SocketRig) -> None:
    rig.behaviours["us"].mode = "slow"  # one event, then a generation that goes on
    async with rig.connect() as ws:
        await ws.send(json.dumps(CREATE))
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert first["type"] == "response.created"
    await asyncio.wait_for(rig.behaviours["us"].stream_closed.wait(), 10)


async def test_an_idle_connection_is_closed_going_away(rig: SocketRig) -> None:
    async with rig.connect() as ws:
        await ws.send(json.dumps(CREATE))
        await _until_final(ws)
        await rig.clock.advance_async(29)
        await ws.send(json.dumps(CREATE))  # activity: the idle clock starts again
        await _until_final(ws)
        await rig.clock.settled()
        await rig.clock.advance_async(31)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001


async def test_a_connection_open_too_long_is_closed_between_turns(rig: SocketRig) -> None:
    async with rig.connect() as ws:
        for _ in range(4):
            await ws.send(json.dumps(CREATE))
            await _until_final(ws)
            await rig.clock.settled()
            await rig.clock.advance_async(25)  # never idle 30 s, but 100 s in all
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    await eventually(lambda: rig.behaviours["us"].hits == 4)


async def test_errors_of_the_pipeline_are_error_events(rig: SocketRig) -> None:
    async with rig.connect(LIMITED) as ws:
        await ws.send(json.dumps(CREATE))
        assert (await _until_final(ws))[-1]["type"] == "response.completed"
        await ws.send(json.dumps(CREATE))
        limited = (await _until_final(ws))[-1]
    async with rig.connect() as ws:
        await ws.send(json.dumps({**CREATE, "model": "no-such-model"}))
        unknown = (await _until_final(ws))[-1]
    assert limited["status"] == 429 and limited["error"]["code"] == "rate_limit_exceeded"
    assert int(limited["error"]["headers"]["retry-after"]) >= 1
    assert unknown["status"] == 404 and unknown["error"]["code"] == "model_not_found"

