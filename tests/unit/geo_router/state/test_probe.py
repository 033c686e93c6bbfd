"""Active health probes against real HTTP nodes serving a node's real /metrics page."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from router_harness import (
    CLUSTER_TOKEN,
    REGIONS,
    ServerGroup,
    eventually,
    make_table,
    node,
    reserve_port,
    router_settings,
    url_of,
)

from data_plane.engine.base import EngineStats
from data_plane.server.metrics import NodeMetrics
from geo_router.state.health import InProcessFleetState
from geo_router.state.node_load import NodeLoad, parse_node_metrics
from geo_router.state.probe import NodeProber, ProbeResult
from geo_router.state.table import LoadedTable
from meridian.clock import SYSTEM_CLOCK, Clock, ManualClock
from meridian.contracts import NodeStatus, RoutingNode

US = REGIONS["us"].name

# --- parsing what nodes export ---------------------------------------------------------


def test_parses_the_load_a_node_exports():
    stats = EngineStats(running=3, waiting=2, kv_cache_usage=0.25, max_loras=4,
                        running_loras=("sql", "chat", "sql"), waiting_loras=("legal",),
                        loaded_loras=("sql", "chat", "legal"),
                        prefix_cache_queries_total=900, prefix_cache_hits_total=600)
    metrics = NodeMetrics("tiny-llama", lambda: stats,
                          cache_config={"block_size": "32", "enable_prefix_caching": "True"})
    load = parse_node_metrics(metrics.render().decode(), observed_at=12.5)
    assert load == NodeLoad(running=3, waiting=2, kv_usage=0.25, max_loras=4,
                            active_adapters=frozenset({"sql", "chat", "legal"}), block_size=32,
                            prefix_cache_hits=600, prefix_cache_queries=900, observed_at=12.5)


def test_a_node_without_lora_or_cache_config_reads_as_none_of_either():
    metrics = NodeMetrics("tiny-llama", lambda: EngineStats(running=1))
    load = parse_node_metrics(metrics.render().decode())
    assert (load.running, load.max_loras, load.active_adapters, load.block_size) == (1, 0, frozenset(), None)
    assert load.observed_at == pytest.approx(time.monotonic(), abs=5)


VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 4.0
vllm:num_requests_running{engine="1",model_name="llama"} 3.0
vllm:num_requests_running_extra{engine="0",model_name="llama"} 100.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 1.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 5.0 1712345678000
vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="llama"} 0.75
vllm:gpu_cache_usage_perc{engine="2",model_name="llama"} NaN
vllm:lora_requests_info{max_lora="8",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="8",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.8e9
vllm:lora_requests_info{max_lora="8",running_lora_adapters="",waiting_lora_adapters="x"} 1.75e9
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",swap_space="4"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",swap_space="4"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="llama"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 250.0
vllm:prefix_cache_hits_total{engine="1",model_name="llama"} 50.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="llama"} 0.0
this line is not prometheus at all
vllm:num_requests_running{engine="2",model_name="llama"} not-a-number
"""


def test_parses_a_vllm_page_summing_engines_and_taking_the_newest_lora_series():
    load = parse_node_metrics(VLLM_PAGE, observed_at=1.0)
    assert (load.running, load.waiting) == (7, 6)
    assert load.kv_usage == 0.75  # the fullest engine; the pre-0.10 metric name
    assert (load.max_loras, load.active_adapters) == (8, frozenset({"a", "b", "c"}))
    assert load.block_size == 16
    assert (load.prefix_cache_hits, load.prefix_cache_queries) == (300, 1500)


def test_an_empty_or_foreign_page_reads_as_idle():
    assert parse_node_metrics("", observed_at=3.0) == NodeLoad(observed_at=3.0)
    assert parse_node_metrics("# just a comment\nup 1\n", observed_at=3.0) == NodeLoad(observed_at=3.0)


def test_escaped_label_values_are_read_whole():
    page = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="we\\"ird,x}y",waiting_lora_adapters=""} 5\n'
    assert parse_node_metrics(page).active_adapters == frozenset({'we"ird', "x}y"})


# --- stand-in nodes serving /metrics ------------------------------------------------------


@dataclass
class Concurrency:
    now: int = 0
    peak: int = 0


@dataclass
class MetricsNode:
    """A node's /metrics: mode ok (NodeMetrics for `stats`), error500, notfound or hang."""

    stats: EngineStats = field(default_factory=EngineStats)
    mode: str = "ok"
    hits: int = 0
    authorizations: list[str | None] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    concurrency: Concurrency = field(default_factory=Concurrency)


def metrics_app(n: MetricsNode) -> FastAPI:
    app = FastAPI()
    metrics = NodeMetrics("tiny-llama", lambda: n.stats, cache_config={"block_size": "16"})

    @app.get("/metrics")
    async def page(request: Request) -> Response:
        n.hits += 1
        n.authorizations.append(request.headers.get("authorization"))
        n.concurrency.now += 1
        n.concurrency.peak = max(n.concurrency.peak, n.concurrency.now)
        try:
            if n.mode == "hang":
                await n.release.wait()
            if n.mode == "error500":
                return Response("engine dead", status_code=500)
            if n.mode == "notfound":
                return Response("no such page", status_code=404)
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
        finally:
            n.concurrency.now -= 1

    return app


@dataclass
class Rig:
    servers: ServerGroup
    fleet: InProcessFleetState
    nodes: list[MetricsNode] = field(default_factory=list)
    probers: list[NodeProber] = field(default_factory=list)

    async def node(self, name: str, n: MetricsNode | None = None, region: str = "us") -> tuple[MetricsNode, RoutingNode]:
        n = n or MetricsNode()
        self.nodes.append(n)
        url = await self.servers.start(metrics_app(n))
        return n, node(region, url).model_copy(update={"node_id": name})

    def prober(self, nodes: list[RoutingNode], *, clock: Clock = SYSTEM_CLOCK, **settings: Any) -> NodeProber:
        values: dict[str, Any] = {"probe_interval_s": 0.05, "probe_timeout_s": 0.5, **settings}
        prober = NodeProber(router_settings(**values), self.fleet, clock=clock)
        prober.on_table(LoadedTable.build(make_table(nodes)))
        self.probers.append(prober)
        return prober


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(ServerGroup(), InProcessFleetState(ejection_base_s=30, ejection_max_s=120, max_ejected_percent=100))
    try:
        yield r
    finally:
        for prober in r.probers:
            await prober.stop()
        for n in r.nodes:
            n.release.set()
        await r.servers.stop()


# --- one probe at a time ---------------------------------------------------------------


async def test_a_probe_reads_the_nodes_load_with_the_cluster_token(rig: Rig):
    n, us1 = await rig.node("us-1", MetricsNode(EngineStats(running=2, waiting=1, kv_cache_usage=0.5)))
    prober = rig.prober([us1])
    assert prober.load("us-1") is None and prober.rtt_ms(US) is None
    assert await prober.probe("us-1") is ProbeResult.SUCCESS
    load = prober.load("us-1")
    assert load is not None and (load.running, load.waiting, load.kv_usage, load.block_size) == (2, 1, 0.5, 16)
    assert n.authorizations == [f"Bearer {CLUSTER_TOKEN}"]
    rtt = prober.rtt_ms(US)
    assert rtt is not None and 0 < rtt < 500
    assert prober.rtt_ms(REGIONS["eu"].name) is None
    n.stats = EngineStats(running=9)
    await prober.probe("us-1")
    assert prober.load("us-1").running == 9


async def test_a_5xx_node_is_ejected_after_the_unhealthy_threshold(rig: Rig):
    n, us1 = await rig.node("us-1", MetricsNode(mode="error500"))
    prober = rig.prober([us1], probe_unhealthy_threshold=2)
    assert await prober.probe("us-1") is ProbeResult.FAILURE
    assert not rig.fleet.is_ejected("us-1")
    assert await prober.probe("us-1") is ProbeResult.FAILURE
    assert rig.fleet.is_ejected("us-1")
    assert n.hits == 2


async def test_a_node_whose_probes_keep_failing_never_comes_back_between_ejections():
    """The ejection's end is no gap for requests to fall into: each failed probe keeps the
    node out for the base ejection time, so it stays out until probes pass."""
    clock = ManualClock()
    rig = Rig(ServerGroup(), InProcessFleetState(ejection_base_s=5, ejection_max_s=60, clock=clock,
                                                 max_ejected_percent=100))
    try:
        n, us1 = await rig.node("us-1", MetricsNode(mode="error500"))
        prober = rig.prober([us1], probe_unhealthy_threshold=2, probe_healthy_threshold=2, clock=clock)
        await prober.probe("us-1")
        await prober.probe("us-1")
        for _ in range(12):  # probes a second apart for over twice the base ejection
            clock.advance(1.0)
            assert rig.fleet.is_ejected("us-1")  # before this second's probe
            await prober.probe("us-1")
        n.mode = "ok"
        await prober.probe("us-1")
        assert rig.fleet.is_ejected("us-1")
        await prober.probe("us-1")
        assert not rig.fleet.is_ejected("us-1")
    finally:
        await rig.servers.stop()


async def test_a_success_in_between_restarts_the_unhealthy_count(rig: Rig):
    n, us1 = await rig.node("us-1", MetricsNode(mode="error500"))
    prober = rig.prober([us1], probe_unhealthy_threshold=2)
    await prober.probe("us-1")
    n.mode = "ok"
    await prober.probe("us-1")
    n.mode = "error500"
    await prober.probe("us-1")
    assert not rig.fleet.is_ejected("us-1")


async def test_a_refused_connection_and_a_hung_node_are_failures(rig: Rig):
    closed = reserve_port()  # bound, never listening
    try:
        refused = node("us", url_of(closed)).model_copy(update={"node_id": "refused"})
        _, hung = await rig.node("hung", MetricsNode(mode="hang"))
        prober = rig.prober([refused, hung], probe_timeout_s=0.3, probe_unhealthy_threshold=1)
        started = time.monotonic()
        results = await asyncio.gather(prober.probe("refused"), prober.probe("hung"))
        assert results == [ProbeResult.FAILURE, ProbeResult.FAILURE]
        assert time.monotonic() - started < 2
        assert rig.fleet.is_ejected("refused") and rig.fleet.is_ejected("hung")
        assert prober.load("hung") is None
    finally:
        closed.close()


async def test_an_ejected_node_returns_after_the_healthy_threshold(rig: Rig):
    _, us1 = await rig.node("us-1")
    prober = rig.prober([us1], probe_healthy_threshold=2)
    # Successes before the ejection do not count towards its early end.
    for _ in range(3):
        await prober.probe("us-1")
    assert rig.fleet.record_failure("us-1") == 30  # passive: the node refused a request
    await prober.probe("us-1")
    assert rig.fleet.is_ejected("us-1")
    await prober.probe("us-1")
    assert not rig.fleet.is_ejected("us-1")


async def test_a_node_without_a_metrics_page_is_neither_healthy_nor_failing(rig: Rig):
    _, us1 = await rig.node("us-1", MetricsNode(mode="notfound"))
    prober = rig.prober([us1], probe_unhealthy_threshold=1, probe_healthy_threshold=1)
    assert await prober.probe("us-1") is ProbeResult.INCONCLUSIVE
    assert not rig.fleet.is_ejected("us-1")
    rig.fleet.record_failure("us-1")
    await prober.probe("us-1")
    assert rig.fleet.is_ejected("us-1")  # a 404 is no reason to bring it back either
    assert prober.load("us-1") is None


async def test_load_goes_stale_after_three_intervals(rig: Rig):
    _, us1 = await rig.node("us-1", MetricsNode(EngineStats(running=1)))
    clock = ManualClock()
    prober = rig.prober([us1], probe_interval_s=1.0, clock=clock)
    await prober.probe("us-1")
    clock.advance(2.9)
    assert prober.load("us-1") is not None and prober.rtt_ms(US) is not None
    clock.advance(0.2)
    assert prober.load("us-1") is None and prober.rtt_ms(US) is None


async def test_only_ready_nodes_are_probed_and_a_node_leaving_the_table_is_forgotten(rig: Rig):
    _, us1 = await rig.node("us-1")
    draining_node, us2 = await rig.node("us-2")
    us2 = us2.model_copy(update={"status": NodeStatus.DRAINING})
    prober = rig.prober([us1, us2])
    assert await prober.probe("us-2") is None
    await prober.probe("us-1")
    assert prober.load("us-1") is not None
    prober.on_table(LoadedTable.build(make_table([us2], version=2)))
    assert prober.load("us-1") is None
    assert await prober.probe("us-1") is None
    assert draining_node.hits == 0


async def test_the_max_ejected_percent_is_a_share_of_the_tables_ready_nodes(rig: Rig):
    fleet = InProcessFleetState(ejection_base_s=30, ejection_max_s=120, max_ejected_percent=50)
    rig.fleet = fleet
    nodes = [node("us", f"http://127.0.0.1:1/{i}").model_copy(update={"node_id": f"n{i}"}) for i in range(4)]
    nodes[3] = nodes[3].model_copy(update={"status": NodeStatus.STARTING})
    rig.prober(nodes)  # 3 READY nodes: at 50%, one may be ejected
    assert fleet.record_failure("n0") == 30
    assert fleet.record_failure("n1") == 0


# --- probing in the background -----------------------------------------------------------


async def test_background_probes_follow_a_node_going_down_and_coming_back(rig: Rig):
    n, us1 = await rig.node("us-1", MetricsNode(EngineStats(running=1)))
    prober = rig.prober([us1], probe_interval_s=0.05)
    await prober.start()
    await eventually(lambda: prober.load("us-1") is not None)
    n.stats = EngineStats(running=5)
    await eventually(lambda: prober.load("us-1").running == 5)
    n.mode = "error500"
    await eventually(lambda: rig.fleet.is_ejected("us-1"))
    n.mode = "ok"
    await eventually(lambda: not rig.fleet.is_ejected("us-1"))


async def test_a_node_added_while_running_is_probed(rig: Rig):
    _, us1 = await rig.node("us-1")
    _, us2 = await rig.node("us-2", MetricsNode(EngineStats(waiting=3)))
    prober = rig.prober([us1])
    await prober.start()
    prober.on_table(LoadedTable.build(make_table([us1, us2], version=2)))
    await eventually(lambda: prober.load("us-2") is not None)
    assert prober.load("us-2").waiting == 3


async def test_probes_in_flight_are_bounded_and_stop_is_prompt(rig: Rig):
    shared = Concurrency()
    routing_nodes = []
    for i in range(4):
        _, rn = await rig.node(f"hung-{i}", MetricsNode(mode="hang", concurrency=shared))
        routing_nodes.append(rn)
    clock = ManualClock()
    prober = rig.prober(routing_nodes, probe_concurrency=2, probe_timeout_s=5.0, clock=clock)
    await prober.start()
    await eventually(lambda: clock.sleepers == 1)  # the scheduler, until the first probe is due
    await clock.advance_async(0.05)  # the first interval: every node's first probe is due
    await eventually(lambda: shared.now == 2)
    for _ in range(4):  # more intervals pass: still only two in flight
        await clock.advance_async(0.05)
    # None waits for its next interval: two probe, two wait for the semaphore.
    assert clock.sleepers == 0
    assert shared.peak == 2
    started = time.monotonic()
    await prober.stop()
    assert time.monotonic() - started < 0.5


async def test_probes_are_off_when_disabled(rig: Rig):
    n, us1 = await rig.node("us-1")
    clock = ManualClock()
    prober = rig.prober([us1], probe_enabled=False, clock=clock)
    await prober.start()
    await clock.advance_async(0)  # a probe task, were there one, would now wait for its interval
    assert clock.sleepers == 0
    for _ in range(4):  # several intervals: nothing may happen in them
        await clock.advance_async(0.05)
    assert n.hits == 0 and prober.load("us-1") is None
