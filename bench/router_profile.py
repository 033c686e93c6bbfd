"""Where the router's CPU goes per request: a sampling profile of a saturated router.

    python -m bench.router_profile [--seconds 10] [--concurrency 32] [--top 10] [--rate 250]
                                   [--stream EVENTS]

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
EVENTS events relayed with migration on (each request is then a whole stream).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import uvloop

from bench.http_load import saturate
from bench.router import REQUEST_BODY, ROUTE, TENANT_KEY, chat_node, make_target, router_process
from bench.stream_relay import stream_node, stream_target


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


def run(seconds: float, concurrency: int, top: int, rate: int, keep: Path | None, stream: int = 0) -> None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory(prefix="bench-router-profile-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        out = work / "router.collapsed"
        node = stack.enter_context(stream_node(work / "node", stream) if stream else chat_node(work / "node"))
        router = stack.enter_context(router_process(work / "router", node.url))
        target = (stream_target("router", router.url, router.pid) if stream
                  else make_target("router", router.url, TENANT_KEY, router.pid))
        warmup_s = 1.0
        # py-spy starts sampling while the warm-up runs, and stops after the counted window.
        spy = subprocess.Popen(
            [py_spy, "record", "--pid", str(router.pid), "--rate", str(rate), "--duration", str(round(seconds)),
             "--format", "raw", "--output", str(out), "--function", "--gil"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            sat = runner.run(saturate(target, concurrency, seconds, warmup_s=warmup_s))
        _, err = spy.communicate(timeout=60)
        if spy.returncode != 0 or not out.exists():
            sys.exit(f"py-spy failed: {err.decode(errors='replace')[-800:]}")
        cpu = sat.cpu_per_request_ms or 0.0
        print(f"# {sat.rps:.0f} req/s at concurrency {concurrency}, {cpu:.3f} ms CPU per request, {sat.errors}"
              f" errors; POST {ROUTE} " + (f"streamed, {stream} events" if stream else f"with a {len(REQUEST_BODY)}-byte body"))
        print(f"{'µs/req':>7}  {'share':>6}  function (self time)")
        for cost in top_costs(out.read_text(), cpu, top):
            print(f"{cost.us_per_request:7.1f}  {cost.share:6.1%}  {cost.where}")
        if keep is not None:
            shutil.copyfile(out, keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of closed-loop load, sampled")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--top", type=int, default=10, help="how many functions to list")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--raw", type=Path, default=None, help="keep the collapsed stacks in this file")
    ap.add_argument("--stream", type=int, default=0, metavar="EVENTS",
                    help="profile a streamed answer of EVENTS events (migration on) instead")
    args = ap.parse_args()
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        sys.exit("nginx is needed for the node (apt-get install nginx)")
    run(args.seconds, args.concurrency, args.top, args.rate, args.raw, args.stream)


if __name__ == "__main__":
    main()
