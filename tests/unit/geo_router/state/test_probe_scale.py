"""The prober at fleet scale: a per-router probe budget, and following deltas by what changed.

A few real local HTTP servers stand in for many nodes (each node's URL is a path on one of
them); time runs on a ManualClock, the probes themselves over real HTTP.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from router_harness import ServerGroup, eventually, make_table, node, router_settings

from data_plane.engine.base import EngineStats
from data_plane.server.metrics import NodeMetrics
from geo_router.state.health import InProcessFleetState
from geo_router.state.probe import NodeProber, ProbeResult
from geo_router.state.table import LoadedTable
from meridian.clock import ManualClock
from meridian.contracts import NodeStatus, RoutingNode, RoutingTableDelta


@dataclass
class Pages:
    """Serves /<node>/metrics for any node, noting when (on the clock) each was asked."""

    clock: ManualClock
    running: int = 1
    asked: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))

    def app(self) -> FastAPI:
        app = FastAPI()
        metrics = NodeMetrics("tiny-llama", lambda: EngineStats(running=self.running))

        @app.get("/{node_id}/metrics")
        async def page(node_id: str) -> Response:
            self.asked[node_id].append(self.clock.monotonic())
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

        return app

    @property
    def total(self) -> int:
        return sum(len(times) for times in self.asked.values())


@dataclass
class Rig:
    clock: ManualClock
    servers: ServerGroup
    fleet: InProcessFleetState
    urls: list[str] = field(default_factory=list)
    pages: list[Pages] = field(default_factory=list)
    probers: list[NodeProber] = field(default_factory=list)

    async def serve(self, count: int) -> None:
        for _ in range(count):
            self.pages.append(Pages(self.clock))
            self.urls.append(await self.servers.start(self.pages[-1].app()))

    def nodes(self, count: int, server: int | None = None) -> list[RoutingNode]:
        return [self.node(f"n{i:05d}", server if server is not None else i % len(self.urls)) for i in range(count)]

    def node(self, node_id: str, server: int) -> RoutingNode:
        return node("us", f"{self.urls[server]}/{node_id}").model_copy(update={"node_id": node_id})

    def prober(self, nodes: list[RoutingNode], **settings: Any) -> NodeProber:
        values: dict[str, Any] = {"probe_interval_s": 1.0, "probe_timeout_s": 5.0, **settings}
        prober = NodeProber(router_settings(**values), self.fleet, clock=self.clock)
        prober.on_table(LoadedTable.build(make_table(nodes)))
        self.probers.append(prober)
        return prober

    @property
    def asked(self) -> dict[str, list[float]]:
        merged: dict[str, list[float]] = collections.defaultdict(list)
        for p in self.pages:
            for node_id, times in p.asked.items():
                merged[node_id] += times
        return merged

    async def run_for(self, prober: NodeProber, seconds: float, step_s: float = 0.25) -> None:
        """Move the clock on by `seconds`, letting the probes due at each step answer."""
        for _ in range(round(seconds / step_s)):
            await self.clock.advance_async(step_s)
            await eventually(lambda: prober.in_flight == 0)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(ManualClock(), ServerGroup(), InProcessFleetState(ejection_base_s=30, ejection_max_s=120,
                                                              max_ejected_percent=50))
    try:
        yield r
    finally:
        for prober in r.probers:
            await prober.stop()
        await r.servers.stop()


async def test_a_large_fleet_is_probed_within_the_budget_and_every_node_within_the_interval(rig: Rig):
    await rig.serve(4)
    nodes = rig.nodes(200)
    prober = rig.prober(nodes, probe_max_per_s=10)  # 200 nodes at 10/s: each every 20 s
    assert prober.interval_s == 20.0
    start = rig.clock.monotonic()
    await prober.start()
    await rig.run_for(prober, 60.0, step_s=0.5)
    asked = rig.asked
    # Every node: its first probe within the first interval, then one every 20 s +- 10%.
    assert set(asked) == {n.node_id for n in nodes}
    for times in asked.values():
        assert times[0] - start <= 20.0 + 0.5
        assert all(18.0 - 0.5 <= b - a <= 22.0 + 0.5 for a, b in zip(times, times[1:], strict=False))
    # The rate: 10 probes a second on average, and in each interval (each node once, or
    # twice when the jitter shortens its interval) within the jitter's margin.
    every = sorted(t - start for times in asked.values() for t in times)
    assert 0.9 * 10 * 60 <= len(every) <= 1.05 * 10 * 60
    for window in range(3):
        assert sum(1 for t in every if window * 20 <= t < (window + 1) * 20) <= 1.15 * 10 * 20
    # Load stays known for three effective intervals: the fleet is not routed blind.
    await rig.run_for(prober, 0)
    assert len(prober.loads()) == 200


async def test_a_fleet_within_the_budget_is_probed_at_the_configured_interval(rig: Rig):
    await rig.serve(1)
    prober = rig.prober(rig.nodes(4), probe_max_per_s=200)
    assert prober.interval_s == 1.0
    start = rig.clock.monotonic()
    await prober.start()
    await rig.run_for(prober, 10.0, step_s=0.05)
    for times in rig.asked.values():
        assert times[0] - start <= 1.0 + 0.05
        assert all(0.9 - 0.05 <= b - a <= 1.1 + 0.05 for a, b in zip(times, times[1:], strict=False))
        assert 9 <= len(times) <= 11
    await prober.stop()
    last = [times[-1] for times in rig.asked.values()]
    rig.clock.advance(min(last) + 2.95 - rig.clock.monotonic())
    assert len(prober.loads()) == 4  # stale after three configured intervals, as before
    rig.clock.advance(max(last) + 3.1 - rig.clock.monotonic())
    assert prober.loads() == {}


async def test_a_delta_is_followed_for_the_nodes_it_changed(rig: Rig):
    await rig.serve(2)
    rig.pages[1].running = 7
    a, b, c, d = (rig.node(name, 0) for name in ("a", "b", "c", "d"))
    loaded = LoadedTable.build(make_table([a, b, c, d]))
    prober = rig.prober([])
    prober.on_table(loaded)  # 4 READY nodes at 50%: two may be ejected
    await prober.start()
    assert await prober.probe("a") is ProbeResult.SUCCESS and prober.load("a").running == 1

    # a moves to another server, b drains, c leaves, e joins.
    e = rig.node("e", 0)
    moved = a.model_copy(update={"url": f"{rig.urls[1]}/a"})
    draining = b.model_copy(update={"status": NodeStatus.DRAINING})
    prober.on_table(loaded.apply(RoutingTableDelta(
        base_version=1, base_build="b1", version=2, build="b2", generated_at=datetime.now(UTC),
        nodes_upserted=[moved, draining, e], nodes_removed=["c"],
    )))
    assert await prober.probe("a") is ProbeResult.SUCCESS and prober.load("a").running == 7
    assert rig.pages[1].asked["a"]
    assert await prober.probe("b") is None and await prober.probe("c") is None
    assert await prober.probe("e") is ProbeResult.SUCCESS
    # The max ejected percent is now a share of a, d and e: one of three may be ejected.
    assert rig.fleet.record_failure("a") == 30
    assert rig.fleet.record_failure("d") == 0
    # The background probes follow the new table too: e is probed, b and c are not.
    before = {name: len(rig.asked.get(name, [])) for name in "bcde"}
    await rig.run_for(prober, 2.0)
    after = {name: len(rig.asked.get(name, [])) for name in "bcde"}
    assert after["b"] == before["b"] and after["c"] == before["c"]
    assert after["d"] > before["d"] and after["e"] > before["e"]
