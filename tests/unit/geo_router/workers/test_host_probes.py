"""One prober for the workers of a router (geo_router.workers.host_probes): one worker probes,
the others route by the loads and round trips it found, and a sibling takes over when it stops."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from router_harness import REGIONS, ServerGroup, eventually, make_table, node, router_settings

from data_plane.engine.base import EngineStats
from data_plane.server.metrics import NodeMetrics
from geo_router.state.health import InProcessFleetState
from geo_router.state.node_load import NodeLoad
from geo_router.state.probe import NodeProber
from geo_router.state.table import LoadedTable
from geo_router.workers.host_probes import HostProbeShare, ProbeLease, create_ring
from meridian.clock import ManualClock

US = REGIONS["us"].name
INTERVAL_S = 1.0


@dataclass
class Node:
    stats: EngineStats = field(default_factory=lambda: EngineStats(running=3, waiting=1, kv_cache_usage=0.5))
    hits: int = 0


def metrics_app(n: Node) -> FastAPI:
    app = FastAPI()
    metrics = NodeMetrics("tiny-llama", lambda: n.stats, cache_config={"block_size": "16"})

    @app.get("/metrics")
    async def page() -> Response:
        n.hits += 1
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


@dataclass
class Workers:
    clock: ManualClock
    node: Node
    probers: list[NodeProber]

    def started(self) -> int:
        return sum(p.probes_started for p in self.probers)

    async def intervals(self, n: int) -> None:
        """n intervals, each with the node probed once (by whichever worker leads)."""
        for _ in range(n):
            before = self.started()
            for _ in range(3):  # a worker taking the lead over may skip one due probe
                await self.clock.advance_async(INTERVAL_S * 0.55)
                if self.started() > before:
                    break
            await eventually(lambda: self.started() > before  # noqa: B023 - read at once
                             and all(p.in_flight == 0 for p in self.probers))


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[Workers]:
    servers = ServerGroup()
    n = Node()
    url = await servers.start(metrics_app(n))
    table = LoadedTable.build(make_table([node("us", url).model_copy(update={"node_id": "us-1"})]))
    create_ring(tmp_path / "news", 64)
    clock = ManualClock()
    settings = router_settings(probe_interval_s=INTERVAL_S, probe_timeout_s=2.0)
    probers = []
    for i in range(2):
        share = HostProbeShare.for_worker(tmp_path / "news", tmp_path / "lease", i, INTERVAL_S, clock)
        prober = NodeProber(settings, InProcessFleetState.from_settings(settings, clock), clock=clock, share=share)
        prober.on_table(table)
        probers.append(prober)
    try:
        for prober in probers:
            await prober.start()
        yield Workers(clock, n, probers)
    finally:
        for prober in probers:
            await prober.stop()
        await servers.stop()


async def test_one_worker_probes_and_the_other_routes_by_what_it_found(workers: Workers) -> None:
    a, b = workers.probers
    await workers.intervals(3)
    # Each interval the node answered one probe, not one per worker.
    assert workers.node.hits == a.probes_started + b.probes_started == 3
    lead, other = (a, b) if a.probes_started else (b, a)
    assert other.probes_started == 0
    seen = other.load("us-1")
    assert seen is not None and (seen.running, seen.waiting, seen.kv_usage, seen.block_size) == (3, 1, 0.5, 16)
    assert seen == lead.load("us-1")
    assert other.rtt_ms(US) == lead.rtt_ms(US) is not None

    workers.node.stats = EngineStats(running=7)
    await workers.intervals(1)
    assert (other.load("us-1") or NodeLoad()).running == 7


async def test_a_sibling_takes_the_probing_over_when_the_lead_stops(workers: Workers) -> None:
    await workers.intervals(1)
    lead = next(p for p in workers.probers if p.probes_started)
    other = next(p for p in workers.probers if p is not lead)
    await lead.stop()  # a worker leaving (one that dies lets the lock go the same way)
    hits = workers.node.hits
    await workers.intervals(2)
    assert other.probes_started >= 1 and workers.node.hits == hits + other.probes_started
    workers.node.stats = EngineStats(running=5)
    await workers.intervals(1)
    assert (other.load("us-1") or NodeLoad()).running == 5


def test_the_lease_is_one_holders_and_a_waiting_worker_tries_once_per_interval(tmp_path: Path) -> None:
    clock = ManualClock()
    first, second = (ProbeLease(tmp_path / "lease", INTERVAL_S, clock) for _ in range(2))
    assert first.held() and not second.held()
    first.release()
    assert not second.held()  # it tried a moment ago: not again within the interval
    clock.advance(INTERVAL_S)
    assert second.held() and not first.held()


def test_a_load_with_hundreds_of_adapters_is_shared_without_them(tmp_path: Path) -> None:
    create_ring(tmp_path / "news", 8)
    lead, other = (HostProbeShare.for_worker(tmp_path / "news", tmp_path / "lease", i, INTERVAL_S)
                   for i in range(2))
    few = NodeLoad(running=2, active_adapters=frozenset({"sql", "chat"}), observed_at=5.0)
    many = NodeLoad(running=4, active_adapters=frozenset(f"adapter-{i:04d}" for i in range(500)), observed_at=6.0)
    lead.tell_load("us-1", few)
    lead.tell_load("us-2", many)
    lead.tell_rtt(US, 12.5, 6.0)
    loads, rtts = other.news()
    assert loads == [("us-1", few), ("us-2", NodeLoad(running=4, observed_at=6.0))]
    assert rtts == [(US, 12.5, 6.0)]
    assert other.news() == ([], [])
