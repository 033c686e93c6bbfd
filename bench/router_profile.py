"""Where the router's CPU goes per request: a sampling profile of a saturated router.

    python -m bench.router_profile [--seconds 10] [--concurrency 32] [--top 10] [--rate 250]
                                   [--stream EVENTS | --grpc | --ws]

bench.router's set-up (nginx as the node, `meridian router serve` from a snapshot) under
`--seconds` of closed-loop load, sampled from outside by py-spy (`--rate` samples a second,
the process paused only to read its stack: an in-process profiler's hooks cost more than
the small functions they time, and would inflate them), counting only samples of the thread
holding the GIL (the router's loop at work, not its idle helper threads). The top costs are the functions
with the most self time (a sample's innermost Python frame), each as µs of CPU per request
and as a share of the samples in which the router was running; the same run's CPU per
request (from /proc) is printed first. The table is what BENCHMARKS.md quotes before and
after a change to the hot path; `--raw FILE` keeps the collapsed stacks (flamegraph.pl,
speedscope). py-spy is a dev dependency; it reads the router's memory, as root does here.
`--stream EVENTS` profiles bench.stream_relay's case instead: a streamed chat completion of
EVENTS events relayed with migration on (each request is then a whole stream); `--grpc` and
`--ws` bench.protocols' gRPC call and WebSocket turn (each request is then one call or turn).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import uvloop

from bench.http_load import Saturation, saturate
from bench.protocol_load import KServeClient, ResponsesSockets, saturate_calls
from bench.protocols import PROMPT, SAMPLING, WS_TURN, protocol_node
from bench.router import (
    MODEL,
    REQUEST_BODY,
    ROUTE,
    TENANT_KEY,
    RunningRouter,
    chat_node,
    make_target,
    router_process,
)
from bench.stream_relay import stream_node, stream_target
from chaos.protocols import infer_request
from meridian.ports import free_port


@dataclass(frozen=True)
class Cost:
    """One function's self time in the profile."""

    where: str
    samples: int
    share: float
    us_per_request: float


def top_costs(collapsed: str, cpu_per_request_ms: float, top: int) -> list[Cost]:
    """The `top` functions by self time: each one's share of the samples, and that share of
    the CPU per request measured from /proc."""
    leaves: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        leaves[_short(leaf)] += int(count)
    total = sum(leaves.values()) or 1
    return [Cost(where, n, n / total, n / total * cpu_per_request_ms * 1000) for where, n in leaves.most_common(top)]


def _short(frame: str) -> str:
    """`fn (path/to/module.py:12)` as `fn (module.py:12)`, with the package for our modules."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")")
    parts = Path(path).parts
    return f"{name} ({'/'.join(parts[-2:]) if len(parts) > 1 else path})"


@dataclass(frozen=True)
class Case:
    """What the router is profiled serving: `stream` events a streamed answer (0: a plain
    POST), or a `protocol` other than HTTP (grpc: KServe ModelInfer, ws: a Responses turn)."""

    stream: int = 0
    protocol: str = "http"
    env: tuple[tuple[str, str], ...] = ()  # the router's settings, as environment variables

    def describe(self) -> str:
        if self.protocol == "grpc":
            return "gRPC ModelInfer (unary), which the router makes a POST /v1/completions"
        if self.protocol == "ws":
            return "one response.create turn on an open WebSocket, which the router makes a streamed chat"
        return f"POST {ROUTE} " + (f"streamed, {self.stream} events" if self.stream
                                   else f"with a {len(REQUEST_BODY)}-byte body")


def run(seconds: float, concurrency: int, top: int, rate: int, keep: Path | None, case: Case) -> None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory(prefix="bench-router-profile-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        out = work / "router.collapsed"
        router, load = _set_up(stack, work, case, concurrency, seconds)
        # py-spy starts sampling while the warm-up runs, and stops after the counted window.
        spy = subprocess.Popen(
            [py_spy, "record", "--pid", str(router.pid), "--rate", str(rate), "--duration", str(round(seconds)),
             "--format", "raw", "--output", str(out), "--function", "--gil"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            sat = runner.run(load())
        _, err = spy.communicate(timeout=60)
        if spy.returncode != 0 or not out.exists():
            sys.exit(f"py-spy failed: {err.decode(errors='replace')[-800:]}")
        cpu = sat.cpu_per_request_ms or 0.0
        print(f"# {sat.rps:.0f} req/s at concurrency {concurrency}, {cpu:.3f} ms CPU per request, {sat.errors}"
              f" errors; {case.describe()}")
        print(f"{'µs/req':>7}  {'share':>6}  function (self time)")
        for cost in top_costs(out.read_text(), cpu, top):
            print(f"{cost.us_per_request:7.1f}  {cost.share:6.1%}  {cost.where}")
        if keep is not None:
            shutil.copyfile(out, keep)


WARMUP_S = 1.0


def _set_up(stack: contextlib.ExitStack, work: Path, case: Case, concurrency: int,
            seconds: float) -> tuple[RunningRouter, Callable[[], Awaitable[Saturation]]]:
    """The node and router for `case`, and the saturating load to run on them."""
    if case.protocol == "http":
        node = stack.enter_context(stream_node(work / "node", case.stream) if case.stream else chat_node(work / "node"))
        router = stack.enter_context(router_process(work / "router", node.url, dict(case.env)))
        target = (stream_target("router", router.url, router.pid) if case.stream
                  else make_target("router", router.url, TENANT_KEY, router.pid))
        return router, lambda: saturate(target, concurrency, seconds, warmup_s=WARMUP_S)
    grpc_port = free_port()
    node = stack.enter_context(protocol_node(work / "node"))
    router = stack.enter_context(router_process(work / "router", node.url,
                                                {**dict(case.env), "MERIDIAN_ROUTER_GRPC_PORT": str(grpc_port)}))

    async def load() -> Saturation:
        if case.protocol == "grpc":
            grpc = KServeClient(grpc_port, TENANT_KEY)
            infer = infer_request(MODEL, PROMPT, SAMPLING, stream=False)

            async def call() -> None:
                await grpc.infer(infer)

            try:
                return await saturate_calls(call, router.pid, concurrency, seconds, WARMUP_S)
            finally:
                await grpc.close()
        sockets = ResponsesSockets(int(router.url.rsplit(":", 1)[1]), TENANT_KEY)
        turn = json.dumps(WS_TURN, separators=(",", ":"))
        await sockets.fill(concurrency)
        try:
            return await saturate_calls(lambda: sockets.turn(turn), router.pid, concurrency, seconds, WARMUP_S)
        finally:
            await sockets.close()

    return router, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of closed-loop load, sampled")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--top", type=int, default=10, help="how many functions to list")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--raw", type=Path, default=None, help="keep the collapsed stacks in this file")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of the router (e.g. MERIDIAN_ROUTER_MIGRATION_ENABLED=false); repeatable")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--stream", type=int, default=0, metavar="EVENTS",
                      help="profile a streamed answer of EVENTS events (migration on) instead")
    what.add_argument("--grpc", action="store_const", const="grpc", dest="protocol", default="http",
                      help="profile KServe v2 ModelInfer calls over gRPC instead")
    what.add_argument("--ws", action="store_const", const="ws", dest="protocol",
                      help="profile Responses turns over open WebSockets instead")
    args = ap.parse_args()
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        sys.exit("nginx is needed for the node (apt-get install nginx)")
    env = tuple((name, value) for name, _, value in (e.partition("=") for e in args.env))
    run(args.seconds, args.concurrency, args.top, args.rate, args.raw, Case(args.stream, args.protocol, env))


if __name__ == "__main__":
    main()
