"""Active probes and install-time listeners at fleet scale (issue 34): what a router pays for
following a large fleet.

    python -m bench.probes [--nodes 1000 10000] [--probe-seconds 8]

A synthetic fleet (100 regions, 100 models, KV events on every node); a change is one node
going from ready to draining and another moving to a new URL. Per fleet size:

- router_install_with_listeners_ms_<n>: router CPU to apply the change's delta and notify the
  prober and the KV subscriber, which follow only the nodes the delta changed, against the
  same install with the listeners following the whole fleet (what every install did before:
  the table given to them without its changed nodes). Median of 7, thread CPU.

At the largest size, against stand-in nodes (a plain asyncio HTTP server in a subprocess on
a few ports, answering /metrics for every node URL, so the router process's CPU is the
prober's alone):

- probes_per_s_<n>: probes started per second under the default budget (probe_max_per_s),
  against the configured rate without a budget (every READY node every probe_interval_s).
- probe_cpu_share_<n>: router CPU (process time / wall time) spent probing under the
  budget, against the same prober with the budget lifted (which asks for n probes/s and
  gets what one core gives).
- probe_cpu_us_per_probe: router CPU per probe (the budget lifted, so that fixed costs are
  spread thin), against the CPU per probe under the budget.
- probe_scheduler_kib_<n>: memory (tracemalloc) of the scheduler holding n idle nodes (heap
  entries), against n sleeping tasks, one per node, as before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import multiprocessing
import socket
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from pydantic import SecretStr

from bench.common import Figure
from geo_router.state.health import InProcessFleetState
from geo_router.state.kv_index import KVIndex
from geo_router.state.kv_subscriber import KVEventSubscriber
from geo_router.state.probe import NodeProber
from geo_router.state.table import LoadedTable
from meridian.clock import ManualClock
from meridian.contracts import NodeStatus, RegionInfo, RoutingNode, RoutingTable, RoutingTableDelta
from meridian.settings.router import RouterSettings

BENCH = "probes"
REGIONS = [
    RegionInfo(name=f"aws:region-{i:03d}", provider="aws", location=f"region-{i:03d}",
               zones=[("us", "eu", "apac")[i % 3]], latitude=(i * 7) % 150 - 70, longitude=(i * 13) % 340 - 170)
    for i in range(100)
]
MODELS = [f"model-{i:03d}" for i in range(100)]
_PAGE = (b"vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
         b"vllm:gpu_cache_usage_perc 0.25\n")


def _node(i: int, base_url: str | None = None) -> RoutingNode:
    host = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"
    return RoutingNode(node_id=f"node-{i:05d}", region=REGIONS[i % len(REGIONS)].name,
                       url=f"{base_url}/node-{i:05d}" if base_url else f"http://{host}:8000",
                       models=[MODELS[i % len(MODELS)]], status=NodeStatus.READY,
                       kv_events=f"tcp://{host}:5557")


def _table(nodes: list[RoutingNode]) -> RoutingTable:
    return RoutingTable(version=1, generated_at=datetime.now(UTC), regions=REGIONS, nodes=nodes,
                        tenants=[], deployments=[])


def _settings(**overrides: object) -> RouterSettings:
    return RouterSettings(cluster_token=SecretStr("bench"), kv_events_enabled=True, **overrides)  # type: ignore[arg-type]


def _thread_cpu_ms(f: Callable[[], object], before: Callable[[], object], rounds: int = 7) -> float:
    """Median thread CPU ms of f(), each round after an untimed before()."""
    times = []
    for _ in range(rounds):
        before()
        started = time.thread_time()
        f()
        times.append(time.thread_time() - started)
    return statistics.median(times) * 1e3


def install_figure(nodes: int) -> Figure:
    table = _table([_node(i) for i in range(nodes)])
    base = LoadedTable.build(table)
    moved = _node(nodes // 2).model_copy(update={"url": "http://10.255.0.1:8000",
                                                  "kv_events": "tcp://10.255.0.1:5557"})
    draining = _node(nodes // 3).model_copy(update={"status": NodeStatus.DRAINING})
    delta_body = RoutingTableDelta(
        base_version=1, base_build="b1", version=2, build="b2", generated_at=datetime.now(UTC),
        nodes_upserted=sorted([moved, draining], key=lambda n: n.node_id),
    ).model_dump_json()
    prober = NodeProber(_settings(), InProcessFleetState(ejection_base_s=5, ejection_max_s=60))
    subscriber = KVEventSubscriber(_settings(), KVIndex())
    listeners = [prober.on_table, subscriber.on_table]

    def back_to_base() -> None:  # untimed: the listeners follow the base table again
        for listener in listeners:
            listener(base)

    def install(whole_fleet: bool) -> None:
        loaded = base.apply(RoutingTableDelta.model_validate_json(delta_body))
        if whole_fleet:  # as before: nothing says what changed
            loaded = dataclasses.replace(loaded, changed_nodes=None, base_version=None)
        for listener in listeners:
            listener(loaded)

    ours = _thread_cpu_ms(lambda: install(False), back_to_base)
    assert prober.interval_s >= 1.0 and prober.in_flight == 0
    before = _thread_cpu_ms(lambda: install(True), back_to_base)
    return Figure(BENCH, f"router_install_with_listeners_ms_{nodes}", ours, before,
                  "listeners following the whole fleet per install (as before)",
                  f"{nodes} nodes: delta install with listeners <= 50 ms, O(changed nodes)", "ms")


# --- stand-in nodes --------------------------------------------------------------------


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(_PAGE)
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(head + _PAGE)
    writer.close()


def _serve(socks: list[socket.socket]) -> None:
    async def main() -> None:
        servers = [await asyncio.start_server(_answer, sock=s) for s in socks]
        await asyncio.gather(*(s.serve_forever() for s in servers))

    asyncio.run(main())


@contextlib.contextmanager
def stand_in_nodes(ports: int = 8) -> Iterator[list[str]]:
    """Base URLs of `ports` listening sockets served by one subprocess."""
    socks = []
    for _ in range(ports):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(1024)
        socks.append(s)
    proc = multiprocessing.get_context("fork").Process(target=_serve, args=(socks,), daemon=True)
    proc.start()
    try:
        yield [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        proc.kill()
        proc.join()
        for s in socks:
            s.close()


async def _probe_for(nodes: list[RoutingNode], seconds: float, **settings: object) -> tuple[float, float]:
    """(probes/s, CPU share) of a prober over `nodes` for `seconds` of wall time."""
    prober = NodeProber(_settings(**{"probe_timeout_s": 5.0, **settings}),
                        InProcessFleetState(ejection_base_s=5, ejection_max_s=60))
    prober.on_table(LoadedTable.build(_table(nodes)))
    wall, cpu = time.perf_counter(), time.process_time()
    await prober.start()
    await asyncio.sleep(seconds)
    probes = prober.probes_started - prober.in_flight
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await prober.stop()
    return probes / wall, cpu / wall


def scheduler_memory(nodes: int) -> Figure:
    """tracemalloc of n idle nodes: the scheduler's heap against a sleeping task per node."""
    table = LoadedTable.build(_table([_node(i) for i in range(nodes)]))

    async def ours() -> int:
        prober = NodeProber(_settings(), InProcessFleetState(ejection_base_s=5, ejection_max_s=60),
                            clock=ManualClock())
        prober.on_table(table)
        tracemalloc.start()
        await prober.start()
        await asyncio.sleep(0)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        await prober.stop()
        return size

    async def task_per_node() -> int:
        clock = ManualClock()
        tracemalloc.start()
        tasks = [asyncio.create_task(clock.sleep(1.0), name=f"probe:{n.node_id}") for n in table.table.nodes]
        await asyncio.sleep(0)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return size

    return Figure(BENCH, f"probe_scheduler_kib_{nodes}", asyncio.run(ours()) / 1024,
                  asyncio.run(task_per_node()) / 1024, "a sleeping task per node (as before)",
                  f"{nodes} idle nodes: one scheduler over a heap of due times", "KiB")


def probe_figures(nodes: int, seconds: float) -> list[Figure]:
    defaults = _settings()
    with stand_in_nodes() as urls:
        fleet = [_node(i, urls[i % len(urls)]) for i in range(nodes)]
        budget_rate, budget_share = asyncio.run(_probe_for(fleet, seconds))
        free_rate, free_share = asyncio.run(_probe_for(fleet, seconds, probe_max_per_s=1e9))
    goal = f"{nodes} nodes, probe_max_per_s={defaults.probe_max_per_s:g}"
    return [
        Figure(BENCH, f"probes_per_s_{nodes}", budget_rate, nodes / defaults.probe_interval_s,
               f"every node every probe_interval_s={defaults.probe_interval_s:g}s (no budget)",
               f"{goal}: within the budget", "probes/s"),
        Figure(BENCH, f"probe_cpu_share_{nodes}", budget_share, free_share,
               f"budget lifted (achieved {free_rate:.0f} probes/s)", f"{goal}: a small share of a core",
               "core share"),
        Figure(BENCH, "probe_cpu_us_per_probe", free_share / max(free_rate, 1e-9) * 1e6,
               budget_share / max(budget_rate, 1e-9) * 1e6, "under the budget (fixed costs included)",
               "router CPU per probe, budget lifted", "us"),
    ]


def run(sizes: tuple[int, ...] = (1000,), probe_seconds: float = 4.0) -> list[Figure]:
    figures = [install_figure(n) for n in sizes]
    figures.append(scheduler_memory(max(sizes)))
    figures.extend(probe_figures(max(sizes), probe_seconds))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--probe-seconds", type=float, default=8.0)
    args = parser.parse_args()
    for fig in run(tuple(args.nodes), args.probe_seconds):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
