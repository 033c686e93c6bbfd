"""Instructions per request of one or more builds of the router, counted by callgrind.

    python -m bench.router_callgrind TREE [TREE ...] [--requests 500]

CPU time per request moves by 5% between two runs of the same build on a shared box; the
instructions a request executes do not. Each source tree (e.g. a git worktree of an earlier
build, and `.`) runs as a `meridian router serve` process (bench.router's `router_process`,
probes off) under `valgrind --tool=callgrind --instr-atstart=no` in front of bench.router's
nginx node; after start-up and 50 requests of warm-up, instrumentation is switched on
(`callgrind_control -i on`) for `--requests` sequential requests and off again, and the
program total is read from the output. Figures (bench `router_callgrind`):
`instructions_per_request` of each tree after the first, against the first's. Under valgrind a
router starts in about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from bench.common import Figure
from bench.router import REQUEST_BODY, ROUTE, TENANT_KEY, chat_node, router_process

BENCH = "router_callgrind"
WARMUP = 50
_TOTAL = re.compile(rb"^totals:\s+(\d+)", re.MULTILINE)


def instructions_per_request(tree: Path, node_url: str, work: Path, requests: int) -> float:
    out = work / "callgrind.out"
    wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = {"MERIDIAN_ROUTER_PROBE_ENABLED": "false", **json.loads(os.environ.get("MERIDIAN_BENCH_ROUTER_ENV", "{}"))}
    headers = {"authorization": f"Bearer {TENANT_KEY}", "content-type": "application/json"}
    with router_process(work, node_url, env, source=tree, wrapper=wrapper, start_timeout_s=600) as router, \
            httpx.Client(trust_env=False, timeout=60) as http:
        for _ in range(WARMUP):
            http.post(router.url + ROUTE, content=REQUEST_BODY, headers=headers)
        subprocess.run(["callgrind_control", "-i", "on", str(router.pid)], check=True, capture_output=True)
        for _ in range(requests):
            answer = http.post(router.url + ROUTE, content=REQUEST_BODY, headers=headers)
            if answer.status_code != 200:
                raise AssertionError(f"{tree}: {answer.status_code} {answer.text[:200]}")
        subprocess.run(["callgrind_control", "-i", "off", str(router.pid)], check=True, capture_output=True)
    match = _TOTAL.search(out.read_bytes())
    if match is None:
        raise RuntimeError(f"no instruction total in {out}")
    return int(match.group(1)) / requests


def run(trees: list[Path], requests: int) -> list[Figure]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise RuntimeError("valgrind is needed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="bench-router-callgrind-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        node = stack.enter_context(chat_node(work / "node"))
        counts = [instructions_per_request(tree, node.url, work / f"router-{i}", requests)
                  for i, tree in enumerate(trees)]
    for tree, count in zip(trees, counts, strict=True):
        print(f"# {tree}: {count:,.0f} instructions a request", file=sys.stderr, flush=True)
    return [Figure(BENCH, "instructions_per_request", count, counts[0], f"the router from {trees[0]}",
                   "reported", "instructions") for count in counts[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", type=Path, nargs="+", help="source trees (the first is the baseline)")
    ap.add_argument("--requests", type=int, default=500)
    args = ap.parse_args()
    for fig in run(args.trees, args.requests):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
