"""Two builds of the router side by side: CPU per request at saturation, rounds alternated.

    git worktree add /tmp/before <ref>
    python -m bench.router_ab /tmp/before . [--rounds 10] [--seconds 2] [--stream EVENTS]

A change to the router's hot path is judged by its CPU per request, and one box's noise
between two runs is larger than most changes: here both builds run at once, each a
`meridian router serve` process started from its own source tree (bench.router's
`router_process`, `source=`), in front of
one node (bench.router's nginx answering from memory), and take turns at closed-loop
saturation (32 connections), the order swapped every round; each round's CPU per request
is read from /proc (`--stream EVENTS`: each request is bench.stream_relay's relayed stream of
EVENTS events instead). Figures (bench `router_ab`): `cpu_per_request_ms`, the second tree's
median against the first's (so a ratio under 1 is the second cheaper).
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
from bench.stream_relay import stream_node, stream_target

BENCH = "router_ab"


def run(first: Path, second: Path, rounds: int, seconds: float, stream: int = 0) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="bench-router-ab-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        node = stack.enter_context(stream_node(work / "node", stream) if stream else chat_node(work / "node"))
        targets = []
        for name, tree in (("first", first), ("second", second)):
            router = stack.enter_context(router_process(work / name, node.url, source=tree))
            targets.append(stream_target(name, router.url, router.pid) if stream
                           else make_target(name, router.url, TENANT_KEY, router.pid))
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runs = runner.run(saturate_rounds(targets, rounds, 32, seconds))
    cpu = {name: [x.cpu_per_request_ms or 0.0 for x in xs] for name, xs in runs.items()}
    for name, tree in (("first", first), ("second", second)):
        print(f"# {name} ({tree}): median {median(cpu[name]):.4f} ms CPU per request over {rounds} rounds",
              file=sys.stderr, flush=True)
    return [Figure(BENCH, "cpu_per_request_ms", median(cpu["second"]), median(cpu["first"]),
                   f"the router from {first}, in the same rounds", "reported", "ms")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first", type=Path, help="source tree of the baseline build (e.g. a git worktree)")
    ap.add_argument("second", type=Path, help="source tree of the build under test")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds of saturation per build and round")
    ap.add_argument("--stream", type=int, default=0, metavar="EVENTS",
                    help="requests are bench.stream_relay's streams of EVENTS events (migration on)")
    args = ap.parse_args()
    for fig in run(args.first.resolve(), args.second.resolve(), args.rounds, args.seconds, args.stream):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
