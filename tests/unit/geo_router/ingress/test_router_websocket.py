"""The Responses WebSocket on a real router (its production listener) in front of stand-in
nodes: residency from the key, the pipeline's errors as `error` events, the client leaving
mid-turn, and the connection's idle and age limits on the router's clock.

Every turn is a request (issue 33, findings 2 and 3): warm-ups are size-checked, rate
limited and counted, what a connection remembers is capped per lane and per socket, and a
revoked key closes the socket 1008 at its next turn or, idle, within ws_key_recheck_s."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import websockets
from fastapi import FastAPI
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    LIMITED_KEY,
    MODEL,
    SCRAPE,
    NodeBehaviour,
    ServerGroup,
    eventually,
    make_table,
    metric,
    node,
    node_app,
    router_settings,
    serve_router,
)

from geo_router import create_app
from geo_router.state.table import StaticTableSource
from meridian.clock import ManualClock
from meridian.contracts import TenantEntry
from meridian.security import hash_api_key

CREATE = {"type": "response.create", "model": MODEL, "input": "hi", "store": False}
LIMITED = "mrd_one-request-a-minute"
# The rig's limits: a message (and a turn as sent) is at most 10,000 bytes (the harness's
# max_request_bytes); a lane remembers at most 4,000 and a socket 9,000.
KEY_RECHECK_S = 10.0
LANE_BYTES = 4_000
SOCKET_BYTES = 9_000


@dataclass
class SocketRig:
    url: str
    behaviours: dict[str, NodeBehaviour]
    node_urls: dict[str, str]
    source: StaticTableSource
    clock: ManualClock
    app: FastAPI
    loops: int  # the app's own loops asleep on the clock

    async def asleep(self, sockets: int) -> None:
        """Until `sockets` connections wait on the clock (time moved earlier would not count)."""
        await self.clock.settled(self.loops + sockets)

    def connect(self, key: str = GLOBAL_KEY) -> Any:
        return websockets.connect(self.url, additional_headers={"authorization": f"Bearer {key}"})

    def revoke(self, key: str) -> None:
        """The key is gone from the routing table, as the control plane publishes a revocation."""
        table = self.source.current().table
        kept = [t for t in table.tenants if t.key_hash != hash_api_key(key)]
        self.source.set(table.model_copy(update={"version": table.version + 1, "tenants": kept}))


@contextlib.asynccontextmanager
async def socket_rig(**overrides: Any) -> AsyncIterator[SocketRig]:
    servers = ServerGroup()
    behaviours = {name: NodeBehaviour(name) for name in ("us", "eu")}
    clock = ManualClock()
    try:
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        table = make_table([node(n, u) for n, u in urls.items()])
        table.tenants.append(TenantEntry(key_hash=hash_api_key(LIMITED), key_prefix=LIMITED[:10], tenant="slow",
                                         zone="global", requests_per_minute=1))
        source = StaticTableSource(table)
        settings = router_settings(**{"ws_idle_timeout_s": 30.0, "ws_max_connection_s": 100.0,
                                      "ws_key_recheck_s": KEY_RECHECK_S, "ws_max_lane_bytes": LANE_BYTES,
                                      "ws_max_socket_bytes": SOCKET_BYTES,
                                      # The probes never wake: the clock's sleepers are then
                                      # the app's loops, asleep for good, and the sockets.
                                      "probe_interval_s": 1e9, **overrides})
        app = create_app(settings, table_source=source, clock=clock)
        url = (await serve_router(servers, app, settings)).replace("http://", "ws://") + "/v1/responses"
        await asyncio.sleep(0.2)
        yield SocketRig(url, behaviours, urls, source, clock, app, clock.sleepers)
    finally:
        for b in behaviours.values():
            b.release.set()
        await servers.stop()


@pytest.fixture
async def rig() -> AsyncIterator[SocketRig]:
    async with socket_rig() as made:
        yield made


async def _until_final(ws: Any) -> list[dict[str, Any]]:
    events = []
    while not events or events[-1]["type"] not in ("response.completed", "error"):
        events.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
    return events


async def _turn(ws: Any, event: dict[str, Any]) -> dict[str, Any]:
    """The turn's last event: `response.completed` or `error`."""
    await ws.send(json.dumps(event))
    return (await _until_final(ws))[-1]


def _warm_up(text: str, **fields: Any) -> dict[str, Any]:
    return {**CREATE, "input": text, "generate": False, **fields}


async def _closed(ws: Any, within_s: float = 5) -> int | None:
    """The close code the router sent (events before it are skipped)."""
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            await asyncio.wait_for(ws.recv(), within_s)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


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


async def test_a_warm_up_for_a_model_the_key_may_not_use_is_model_not_found(rig: SocketRig) -> None:
    # A warm-up reaches no replica, so nothing else would tell it the model is not its to use.
    async with rig.connect(LIMITED_KEY) as ws:  # this key may use "other-model" only
        refused = await _turn(ws, _warm_up("context"))
        kept = await _turn(ws, _warm_up("context", model="other-model"))
    assert refused["status"] == 404 and refused["error"]["code"] == "model_not_found"
    assert kept["type"] == "response.completed"



# --- every turn is a request (issue 33) ------------------------------------------------------


async def test_a_warm_up_past_max_request_bytes_is_refused_and_not_kept() -> None:
    async with socket_rig(ws_max_lane_bytes=8_000_000, ws_max_socket_bytes=32_000_000) as rig, \
            rig.connect() as ws:
        first = await _turn(ws, _warm_up("first " + "a" * 6000))
        assert first["type"] == "response.completed"
        # Each message fits, but the conversation it continues makes the turn too large.
        refused = await _turn(ws, _warm_up("second " + "b" * 6000, previous_response_id=first["response"]["id"]))
        assert refused["type"] == "error" and refused["status"] == 413
        assert refused["error"]["code"] == "request_too_large"
        # Nothing of it was kept: the lane continues from the first turn, and the socket is open.
        answer = await _turn(ws, {**CREATE, "previous_response_id": first["response"]["id"]})
    assert answer["type"] == "response.completed"
    sent = json.dumps(rig.behaviours["us"].bodies[-1])
    assert "first " in sent and "second " not in sent


async def test_warm_ups_count_against_the_rate_limit_and_are_accounted(rig: SocketRig) -> None:
    async with rig.connect(LIMITED) as ws:  # one request a minute
        assert (await _turn(ws, _warm_up("context")))["type"] == "response.completed"
        limited = await _turn(ws, _warm_up("more context"))
        generate = await _turn(ws, CREATE)
    for refused in (limited, generate):
        assert refused["status"] == 429 and refused["error"]["code"] == "rate_limit_exceeded"
        assert int(refused["error"]["headers"]["retry-after"]) >= 1
    assert rig.behaviours["us"].hits == 0
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=rig.app), base_url="http://router") as http:
        page = (await http.get("/metrics", headers=SCRAPE)).text
    labels = {"tenant": "slow", "model": MODEL, "zone": "global"}
    assert metric(page, "meridian_router_tenant_requests_total", **labels, status="200") == 1
    assert metric(page, "meridian_router_tenant_requests_total", **labels, status="429") == 2


async def test_chained_warm_ups_stop_at_the_lane_cap_and_keep_nothing_past_it(rig: SocketRig) -> None:
    async with rig.connect() as ws:
        last, kept, refused = None, [], []
        for i in range(12):  # ~1 KB a turn, chained on the last one kept
            marker = f"part-{i:02d} "
            answer = await _turn(ws, _warm_up(marker + "x" * 1000, **({"previous_response_id": last} if last else {})))
            if answer["type"] == "response.completed":
                last = answer["response"]["id"]
                kept.append(marker)
            else:
                refused.append(answer)
        assert len(kept) == 3 and len(refused) == 9
        assert {r["status"] for r in refused} == {400}
        assert {r["error"]["code"] for r in refused} == {"conversation_too_large"}
        assert {r["error"]["param"] for r in refused} == {"input"}
        assert str(LANE_BYTES) in refused[0]["error"]["message"]
        # The socket stays open, and the lane holds the three turns kept, no more.
        answer = await _turn(ws, {**CREATE, "previous_response_id": last})
    assert answer["type"] == "response.completed"
    sent = json.dumps(rig.behaviours["us"].bodies[-1])
    assert [m for m in (f"part-{i:02d} " for i in range(12)) if m in sent] == kept


async def test_the_lanes_of_a_socket_share_one_cap(rig: SocketRig) -> None:
    async with rig.connect() as ws:
        for lane in ("a", "b"):
            assert (await _turn(ws, _warm_up("y" * 3000, stream_id=lane)))["type"] == "response.completed"
        over = await _turn(ws, _warm_up("y" * 3000, stream_id="c"))
        assert over["type"] == "error" and over["stream_id"] == "c"
        assert over["error"]["code"] == "conversation_too_large" and str(SOCKET_BYTES) in over["error"]["message"]
        # A new conversation on a lane takes the place of its old one: room again.
        assert (await _turn(ws, _warm_up("short", stream_id="a")))["type"] == "response.completed"
        assert (await _turn(ws, _warm_up("y" * 3000, stream_id="c")))["type"] == "response.completed"


@pytest.mark.parametrize("generate", [False, True], ids=["warm-up", "generate"])
async def test_a_revoked_key_closes_the_socket_at_its_next_turn(rig: SocketRig, generate: bool) -> None:
    async with rig.connect() as ws:
        assert (await _turn(ws, CREATE))["type"] == "response.completed"
        rig.revoke(GLOBAL_KEY)
        await ws.send(json.dumps({**CREATE, "generate": generate}))
        said = json.loads(await asyncio.wait_for(ws.recv(), 10))
        code = await _closed(ws)
    assert said["type"] == "error" and said["status"] == 401 and said["error"]["code"] == "invalid_api_key"
    assert code == 1008
    assert rig.behaviours["us"].hits == 1  # the first turn only


async def test_an_idle_socket_of_a_revoked_key_closes_within_the_recheck(rig: SocketRig) -> None:
    async with rig.connect() as kept_open, rig.connect(EU_KEY) as ws:
        assert (await _turn(ws, CREATE))["type"] == "response.completed"
        await rig.asleep(2)
        await rig.clock.advance_async(KEY_RECHECK_S)  # a recheck of a key that holds changes nothing
        rig.revoke(EU_KEY)
        await rig.asleep(2)
        await rig.clock.advance_async(KEY_RECHECK_S - 1)
        assert (await _turn(kept_open, CREATE))["type"] == "response.completed"
        await rig.asleep(2)
        await rig.clock.advance_async(1)  # the revoked key's socket: last checked 10 s ago
        assert await _closed(ws) == 1008
        # The other key's socket is still served.
        assert (await _turn(kept_open, CREATE))["type"] == "response.completed"
