"""Every core: one router process against `--workers N`, same node, same run.

    python -m bench.router_workers [--workers N] [--rounds 5] [--seconds 3]

Two `meridian router serve` processes in front of one node (bench.router's nginx answering
from memory): one with a single worker, one with N (default: the CPUs this process may use),
taking turns at closed-loop saturation (64 connections), the order swapped every round.
Figures (bench `router_workers`): `throughput_vs_one_worker`, requests per second answered
with N workers against one, and `cpu_per_request_vs_one_worker`, the CPU every process of
each router (its supervisor and workers) spends per request, which shows what sharing state
between the workers costs. On a box where the load generator and the node share the cores
with the router, the throughput ratio is bounded by what they leave free: read it with the
box's core count (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path

import uvloop

from bench.common import Figure, median
from bench.http_load import saturate_rounds
from bench.router import TENANT_KEY, chat_node, make_target, router_process
from meridian.cpus import usable_cpus, worker_count

BENCH = "router_workers"
CONCURRENCY = 64


def run(workers: int, rounds: int, seconds: float) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="bench-router-workers-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        node = stack.enter_context(chat_node(work / "node"))
        targets = []
        for name, count in (("one", 1), ("many", workers)):
            router = stack.enter_context(router_process(work / name, node.url, {"MERIDIAN_ROUTER_WORKERS": str(count)}))
            targets.append(make_target(name, router.url, TENANT_KEY, router.pid))
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runs = runner.run(saturate_rounds(targets, rounds, CONCURRENCY, seconds))
    rps = {name: median([x.rps for x in xs]) for name, xs in runs.items()}
    cpu = {name: median([x.cpu_per_request_ms or 0.0 for x in xs]) for name, xs in runs.items()}
    print(f"# {usable_cpus()} CPUs; 1 worker: {rps['one']:.0f} req/s, {cpu['one']:.4f} ms CPU per request; "
          f"{workers} workers: {rps['many']:.0f} req/s, {cpu['many']:.4f} ms", file=sys.stderr, flush=True)
    return [
        Figure(BENCH, "throughput_vs_one_worker", rps["many"], rps["one"],
               f"one worker, max req/s (concurrency {CONCURRENCY}, {workers} workers, {usable_cpus()} CPUs)",
               "reported", "req/s"),
        Figure(BENCH, "cpu_per_request_vs_one_worker", cpu["many"], cpu["one"],
               f"one worker, CPU per request at saturation ({workers} workers)", "reported", "ms"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=0, help="workers of the second router (0: one per CPU)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of saturation per router and round")
    args = ap.parse_args()
    workers = worker_count(args.workers)
    for fig in run(workers, args.rounds, args.seconds):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
