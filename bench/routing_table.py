"""The routing-table stream at fleet scale: what one node's change costs the control plane and
the routers, and what a request's candidate selection costs, at 1,000 and 10,000 nodes.

    python -m bench.routing_table [--nodes 1000 10000] [--routers 50]

A synthetic fleet (100 regions, 100 models, one model per node) in a real control-plane
database (SQLite, migrated), built by the real build_routing_table; one change is one node
going from ready to draining. Per fleet size:

- cp_cpu_ms_per_change_<n>: control-plane CPU (process time, worker threads included) to
  answer `routers` long-polls woken by the change: one shared build and one delta served to
  all of them (control_plane.table_stream; the median of 5 changes), against one build and
  serialization per router as before (50 x the median of 5 measured).
- cp_bytes_per_change_<n>: bytes sent to `routers` routers: a delta each against a full table each.
- router_install_ms_<n>: a router's parse and install of the change (LoadedTable with its
  indexes): the delta applied to its table against the full table parsed (median of 7).
- router_install_with_listeners_ms_<n>: the same, with the router's per-install listeners
  (probe targets, KV event subscriptions) notified: after a delta they look only at the
  nodes it changed, after a full table at every node (bench/probes.py compares the two on
  the same delta).
- select_candidates_us_<n>: one request's candidates from the per-version index against the
  scan of every node the router did before (median of 300).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from pydantic import SecretStr
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from bench.common import Figure
from control_plane.db import migrate
from control_plane.db.engine import make_engine, make_sessionmakers
from control_plane.db.models import Node
from control_plane.routing_table import NodeRows, build_routing_table, bump_version
from control_plane.table_stream import TableStream
from geo_router.selection.candidates import Candidate, select_candidates, tenant_may_use
from geo_router.state.health import InProcessFleetState
from geo_router.state.kv_index import KVIndex
from geo_router.state.kv_subscriber import KVEventSubscriber
from geo_router.state.probe import NodeProber
from geo_router.state.table import LoadedTable
from meridian.contracts import (
    NodeStatus,
    RegionInfo,
    RoutingTable,
    RoutingTableDelta,
    TenantEntry,
)
from meridian.geo import Point, region_rtt_ms
from meridian.settings.router import RouterSettings

BENCH = "routing_table"
REGIONS = [
    RegionInfo(name=f"aws:region-{i:03d}", provider="aws", location=f"region-{i:03d}",
               zones=[("us", "eu", "apac")[i % 3]], latitude=(i * 7) % 150 - 70, longitude=(i * 13) % 340 - 170)
    for i in range(100)
]
MODELS = [f"model-{i:03d}" for i in range(100)]
TENANT = TenantEntry(key_hash="0" * 64, key_prefix="mrd_bench", tenant="bench", zone="global")


def _fill(sessions: sessionmaker[Session], nodes: int) -> None:
    now = datetime.now(UTC)
    with sessions() as session, session.begin():
        session.add_all(
            Node(node_id=f"node-{i:05d}", region=REGIONS[i % len(REGIONS)].name, provider="aws",
                 url=f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000", models=[MODELS[i % len(MODELS)]],
                 engine="vllm", version="0.1", status=NodeStatus.READY.value, load={}, registered_at=now,
                 last_heartbeat=now, kv_events=f"tcp://10.{i // 65536}.{i // 256 % 256}.{i % 256}:5557")
            for i in range(nodes)
        )


def _change(sessions: sessionmaker[Session], node_id: str) -> None:
    with sessions() as session, session.begin():
        session.execute(update(Node).where(Node.node_id == node_id).values(status=NodeStatus.DRAINING.value))
        bump_version(session)


def _cpu(f: Callable[[], object]) -> float:
    """Process CPU seconds (every thread) spent in f()."""
    started = time.process_time()
    f()
    return time.process_time() - started


def _median_s(f: Callable[[], object], rounds: int, before: Callable[[], object] | None = None) -> float:
    """Median CPU seconds of this thread in f() (each round after an untimed before()): on a
    busy box, wall time measures the neighbours."""
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        started = time.thread_time()
        f()
        times.append(time.thread_time() - started)
    return statistics.median(times)


def _serve_change(stream: TableStream, base: tuple[int, str], version: int, routers: int) -> list[bytes]:
    """What `routers` long-polls at `base` get once `version` is committed, as the route does."""

    async def one() -> bytes:
        published = await stream.newest_at_least(version)
        return stream.delta(*base, published) or published.body

    async def all_of_them() -> list[bytes]:
        return list(await asyncio.gather(*(one() for _ in range(routers))))

    return asyncio.run(all_of_them())


def _scan_candidates(table: LoadedTable, tenant: TenantEntry, model: str) -> list[str]:
    """The router's selection before the indexes: every node looked at per request."""
    serving = [n for n in table.table.nodes if model in n.models]
    return [
        n.node_id for n in serving
        if (r := table.regions.get(n.region)) is not None and r.admits(tenant.zone) and n.status == NodeStatus.READY
    ]


def run_size(nodes: int, routers: int) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'cp.db'}"
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            reads, writes = make_sessionmakers(engine)
            _fill(writes, nodes)
            regions = {r.name: r for r in REGIONS}

            def build(known: NodeRows | None = None) -> RoutingTable:
                with reads() as session:
                    return build_routing_table(session, regions, datetime.now(UTC), known)

            return _measure(nodes, routers, build, lambda node_id: _change(writes, node_id))
        finally:
            engine.dispose()


def _measure(nodes: int, routers: int, build: Callable[[NodeRows | None], RoutingTable], change: Callable[[str], None]) -> list[Figure]:
    stream = TableStream(build, max_versions=64, max_bytes=256 * 1024 * 1024)
    version = build(None).version
    _serve_change(stream, (0, ""), version, 1)
    cpu: list[float] = []
    for k in range(5):  # five changes, each served to every router; the median counts
        held = stream.newest()
        assert held is not None
        router_body, base = held.body, (held.table.version, held.table.build)
        change(f"node-{k * nodes // 5:05d}")
        version += 1
        answers: list[bytes] = []
        cpu.append(_cpu(lambda: answers.extend(_serve_change(stream, base, version, routers))))  # noqa: B023
    ours_cpu = statistics.median(cpu)
    delta_body = answers[0]
    assert all(a == delta_body for a in answers) and stream.builds == 6
    newest = stream.newest()
    assert newest is not None
    full_body = newest.body
    # Before: each waiting router got a build and a serialization of its own.
    per_router = statistics.median(_cpu(lambda: build(None).model_dump_json()) for _ in range(5))

    router_table = RoutingTable.model_validate_json(router_body)
    router_loaded = LoadedTable.build(router_table)
    full_ms = _median_s(lambda: LoadedTable.build(RoutingTable.model_validate_json(full_body)), 7) * 1e3
    delta_ms = _median_s(lambda: router_loaded.apply(RoutingTableDelta.model_validate_json(delta_body)), 7) * 1e3
    installed = router_loaded.apply(RoutingTableDelta.model_validate_json(delta_body))
    assert installed.table.model_dump_json().encode() == full_body  # the delta gives the full table
    assert installed == LoadedTable.build(RoutingTable.model_validate_json(full_body))  # and the same lookups

    # What a router does on top with each table: its listeners (probe targets, KV event
    # subscriptions), once per install, not per request.
    listeners = _listeners(router_loaded)

    def install_delta_and_notify() -> None:
        loaded = router_loaded.apply(RoutingTableDelta.model_validate_json(delta_body))
        for listener in listeners:
            listener(loaded)

    def install_full_and_notify() -> None:
        loaded = LoadedTable.build(RoutingTable.model_validate_json(full_body))
        for listener in listeners:
            listener(loaded)

    def back_to_base() -> None:  # each round's delta applies to the table the listeners hold
        for listener in listeners:
            listener(router_loaded)

    notify_delta_ms = _median_s(install_delta_and_notify, 7, back_to_base) * 1e3
    notify_full_ms = _median_s(install_full_and_notify, 7, back_to_base) * 1e3

    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60)
    where = Point(50.0, 8.0)
    model = MODELS[7]
    assert [c.node.node_id for c in select_candidates(installed, TENANT, model, fleet, where)] == \
        _scan_candidates(installed, TENANT, model)
    indexed_us = _median_s(lambda: select_candidates(installed, TENANT, model, fleet, where), 300) * 1e6
    scan_us = _median_s(lambda: select_candidates_by_scan(installed, model, fleet, where), 300) * 1e6

    goal = f"{nodes} nodes, {routers} routers"
    return [
        Figure(BENCH, f"cp_cpu_ms_per_change_{nodes}", ours_cpu * 1e3, per_router * routers * 1e3,
               f"a build per router ({routers} x median of 5)", f"{goal}: one build and one delta for all", "ms"),
        Figure(BENCH, f"cp_bytes_per_change_{nodes}", len(delta_body) * routers, len(full_body) * routers,
               "full table per router", f"{goal}: deltas", "bytes"),
        Figure(BENCH, f"router_install_ms_{nodes}", delta_ms, full_ms, "full table parsed and installed",
               f"{goal}: install <= 50 ms at 10,000 nodes", "ms"),
        Figure(BENCH, f"router_install_with_listeners_ms_{nodes}", notify_delta_ms, notify_full_ms,
               "full table parsed, installed and notified", f"{goal}: probe and KV-subscriber listeners included",
               "ms"),
        Figure(BENCH, f"select_candidates_us_{nodes}", indexed_us, scan_us, "scan of every node",
               f"{goal}: O(candidates) per request", "us"),
    ]


def select_candidates_by_scan(table: LoadedTable, model: str, fleet: InProcessFleetState, where: Point) -> list[Candidate]:
    """select_candidates as it was before the indexes (geo_router.selection.candidates at e472c78)."""
    serving = [n for n in table.table.nodes if model in n.models]
    out: list[Candidate] = []
    for node in serving:
        region = table.regions.get(node.region)
        if region is None or not tenant_may_use(TENANT, region) or node.status != NodeStatus.READY:
            continue
        if fleet.is_ejected(node.node_id):
            continue
        out.append(Candidate(node=node, region=region, rtt_ms=region_rtt_ms(where, region),
                             in_flight=fleet.in_flight(node.node_id)))
    return out


def _listeners(first: LoadedTable) -> list[Callable[[LoadedTable], None]]:
    """The router's per-install listeners (not started: their reaction to a table only)."""
    settings = RouterSettings(cluster_token=SecretStr("bench"), kv_events_enabled=True)
    prober = NodeProber(settings, InProcessFleetState(ejection_base_s=5, ejection_max_s=60))
    subscriber = KVEventSubscriber(settings, KVIndex())
    for listener in (prober.on_table, subscriber.on_table):
        listener(first)
    return [prober.on_table, subscriber.on_table]


def run(sizes: tuple[int, ...] = (1000,), routers: int = 50) -> list[Figure]:
    figures: list[Figure] = []
    for nodes in sizes:
        figures.extend(run_size(nodes, routers))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--routers", type=int, default=50)
    args = parser.parse_args()
    for fig in run(tuple(args.nodes), args.routers):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
