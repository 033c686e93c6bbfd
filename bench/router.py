"""Router overhead and throughput against nginx `proxy_pass` and LiteLLM's proxy, one node, one run.

    python -m bench.router [--rate 500] [--seconds 4] [--rounds 3] [--full] [--no-litellm]

Four paths to the same upstream "node", measured in the same run:
  direct    the node itself;
  router    a real `meridian router serve` process (uvicorn, one process) serving a routing
            table from a snapshot file (its control-plane URL refuses connections);
  nginx     Debian's nginx, one worker, `proxy_pass` with upstream keep-alive;
  litellm   LiteLLM's proxy from PyPI (one worker, master key), the node configured as an
            `openai/` model with `api_base`; installed on demand into `.venv-litellm`
            (bench/litellm_proxy.py). Without it (no network) its figures are null.

The node is nginx answering every POST with `return 200` and a fixed OpenAI
chat.completion body: a C event loop that answers from memory costs a few microseconds
a request, so on two shared cores it takes as little CPU as possible from the proxy under
test and adds no Python of its own to the latency being subtracted (a minimal asyncio
server would cost tens of microseconds a request and jitter with the GC).

The load generator (bench/http_load.py) is this process (the proxies are separate processes): raw keep-alive
HTTP/1.1 connections on uvloop, responses parsed with httptools, latency measured at the
client. Latency is open-loop at a fixed rate (`--rate` req/s for `--seconds`, after a
warm-up that is not counted): requests are sent on schedule whether or not earlier ones
have been answered, each timed from when it was due, on up to 128 connections (more wait
in the client, still timed from when they were due), so a proxy that cannot keep up
queues and shows it. Answers still missing 5 s after the last request count with the
time waited so far: a saturated proxy's percentiles are then lower bounds (stderr says
how many). Maximum throughput is closed-loop: `--concurrency` connections each sending
the next request as soon as the previous one is answered. Paths take turns in rounds (the
order rotating each round), and after each phase the bench waits until the proxy is idle
again, so machine noise and backlogs hit all alike; figures are medians over rounds, an
added latency being the median of per-round differences against `direct`.
On two cores the load generator, node and proxy share the CPU, so nginx's throughput is
bounded by them rather than by nginx: that ratio is reported, not a goal.

Figures (bench `router`): added_p50_ms and added_p99_ms (ours: router - direct; baseline:
nginx - direct), throughput_vs_nginx, cpu_per_request_vs_nginx (the CPU each proxy's
processes spent per answered request while saturated, read from /proc: what a router costs
to run, whatever the cores), throughput_vs_litellm, added_p99_vs_litellm.
Raw per-path figures go to stderr as `#` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import uvloop

from bench.common import Figure, median, percentile, stop_process
from bench.http_load import DRAIN_S, Target, open_loop, post_target, saturate, wait_idle
from bench.litellm_proxy import LiteLLMProxy, ensure_litellm
from bench.nginx import NginxServer, nginx_available
from geo_router.state.snapshot import write_snapshot
from meridian.contracts import NodeStatus, RegionInfo, RoutingNode, RoutingTable, TenantEntry
from meridian.ports import free_port
from meridian.security import hash_api_key, key_prefix

BENCH = "router"
MODEL = "bench-model"
ROUTE = "/v1/chat/completions"
REGION = RegionInfo(name="aws:us-east-1", provider="aws", location="us-east-1", zones=["us"],
                    latitude=38.9, longitude=-77.4)
TENANT_KEY = "mrd_router-bench-tenant-key"
REQUEST_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 1}
).encode()
NODE_ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}, separators=(",", ":"))
IDLE_NODE_METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
START_TIMEOUT_S = 60.0


# --- the node and the nginx proxy ---------------------------------------------------


class _NginxConf(NginxServer):
    """NginxServer with a caller-written `http` block body (the port goes where `{port}` is)."""

    def __init__(self, work_dir: Path, server_block: str) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(root=work_dir, work_dir=work_dir, workers=1)
        self._server_block = server_block

    def _conf(self) -> str:
        tmp = self.work_dir / "tmp"
        temp_paths = "\n".join(
            f"    {kind}_temp_path {tmp / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        user = "user root;\n" if os.geteuid() == 0 else ""
        return f"""{user}daemon off;
worker_processes 1;
pid {self.pid_path};
error_log {self.error_log} warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
{temp_paths}
    keepalive_timeout 65s;
    keepalive_requests 1000000;
{self._server_block.replace("{port}", str(self.port))}
}}
"""


def chat_node(work_dir: Path) -> NginxServer:
    """nginx answering every POST to the chat route with NODE_ANSWER from memory, and the
    router's load probe (GET /metrics, vLLM's names) with an idle node."""
    return _NginxConf(work_dir, f"""    server {{
        listen 127.0.0.1:{{port}};
        location = {ROUTE} {{
            default_type application/json;
            return 200 '{NODE_ANSWER}';
        }}
        location = /metrics {{
            default_type text/plain;
            return 200 '{IDLE_NODE_METRICS}';
        }}
    }}""")


def nginx_proxy(work_dir: Path, upstream_port: int) -> NginxServer:
    """nginx `proxy_pass` to the node over pooled keep-alive connections, as one would deploy it."""
    return _NginxConf(work_dir, f"""    upstream node {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{{port}};
        location / {{
            proxy_pass http://node;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}""")


# --- the router -----------------------------------------------------------------------


def bench_table(node_url: str) -> RoutingTable:
    """One region, one ready node serving MODEL, one global tenant with TENANT_KEY."""
    return RoutingTable(
        version=1,
        generated_at=datetime.now(UTC),
        regions=[REGION],
        nodes=[RoutingNode(node_id="bench-node-1", region=REGION.name, url=node_url, models=[MODEL],
                           status=NodeStatus.READY)],
        tenants=[TenantEntry(key_hash=hash_api_key(TENANT_KEY), key_prefix=key_prefix(TENANT_KEY),
                             tenant="bench", zone="global")],
    )


@dataclass(frozen=True)
class RunningRouter:
    url: str
    pid: int


@contextlib.contextmanager
def router_process(work_dir: Path, node_url: str, env_extra: dict[str, str] | None = None,
                   source: Path | None = None, table: RoutingTable | None = None,
                   wrapper: Sequence[str] = (), start_timeout_s: float = START_TIMEOUT_S) -> Iterator[RunningRouter]:
    """`meridian router serve` in front of the node, serving from a snapshot (`env_extra`:
    more MERIDIAN_* settings; `source`: the source tree to run it from, e.g. a git worktree of
    an earlier build, instead of this one; `table`: what it serves instead of bench_table's;
    `wrapper`: a command it runs under, e.g. valgrind's)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    snapshot = work_dir / "routing-table.json"
    write_snapshot(snapshot, table if table is not None else bench_table(node_url))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    # One worker unless `env_extra` says otherwise: the figures are one process's CPU per request.
    env |= {"MERIDIAN_CLUSTER_TOKEN": "router-bench-cluster-token", "PYTHONUNBUFFERED": "1",
            "MERIDIAN_ROUTER_DEFAULT_CLIENT_LOCATION": REGION.name, "MERIDIAN_ROUTER_WORKERS": "1"} | (env_extra or {})
    if source is not None:
        # `-m cli` looks in the working directory first: run there, and import from there.
        env["PYTHONPATH"] = str(source)
    log = work_dir / "router.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "cli", "router", "serve", "--host", "127.0.0.1", "--port", str(port),
             # Nothing listens there: the router serves from its snapshot (static stability).
             "--control-plane-url", f"http://127.0.0.1:{free_port()}", "--snapshot-path", str(snapshot)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            cwd=source,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"router did not start:\n{log.read_text(errors='replace')[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(url + "/health").status_code == 200:
                        break
                time.sleep(0.1)
        yield RunningRouter(url, process.pid)
    finally:
        stop_process(process)


# --- the paths under test -------------------------------------------------------------


def make_target(name: str, url: str, api_key: str, pgid: int | None = None) -> Target:
    return post_target(name, int(url.rsplit(":", 1)[1]), ROUTE, REQUEST_BODY, api_key, pgid)


# --- the run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    rate: float = 500.0
    seconds: float = 3.0
    warmup_s: float = 0.5
    rounds: int = 3
    throughput_seconds: float = 2.0
    throughput_rounds: int = 2
    concurrency: int = 32
    litellm: bool = True
    # More MERIDIAN_* settings for the router process (A/B of a setting, e.g. its access log).
    router_env: tuple[tuple[str, str], ...] = ()


@dataclass
class PathFigures:
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    # CPU the path's processes spent per request while saturated (ms; empty: not measured).
    cpu_ms: list[float] = field(default_factory=list)
    errors: int = 0
    unanswered: int = 0
    sent: int = 0


def _check(target: Target, url: str, headers: dict[str, str]) -> None:
    """One request by an ordinary client: the path answers a chat completion."""
    with httpx.Client(timeout=30.0, trust_env=False) as http:
        r = http.post(url + ROUTE, content=REQUEST_BODY, headers={"content-type": "application/json", **headers})
    if r.status_code != 200 or r.json().get("choices", [{}])[0].get("message", {}).get("content") != "ok":
        raise RuntimeError(f"{target.name} answered {r.status_code}: {r.text[:300]}")


async def _measure(targets: list[Target], s: Settings) -> dict[str, PathFigures]:
    out = {t.name: PathFigures() for t in targets}
    for r in range(s.rounds):
        for t in targets[r % len(targets):] + targets[: r % len(targets)]:
            run = await open_loop(t, s.rate, s.seconds, s.warmup_s)
            f = out[t.name]
            f.errors += run.errors
            f.unanswered += run.unanswered
            f.sent += run.sent
            if run.latencies_ms:
                f.p50_ms.append(percentile(run.latencies_ms, 0.50))
                f.p99_ms.append(percentile(run.latencies_ms, 0.99))
            print(f"# round {r + 1} {t.name:8s} p50 {f.p50_ms[-1] if f.p50_ms else math.nan:9.3f} ms"
                  f"  p99 {f.p99_ms[-1] if f.p99_ms else math.nan:9.3f} ms  errors {run.errors}"
                  f"  unanswered after {DRAIN_S:g} s {run.unanswered}", file=sys.stderr, flush=True)
            await wait_idle(t)
    for r in range(s.throughput_rounds):
        for t in targets[r % len(targets):] + targets[: r % len(targets)]:
            sat = await saturate(t, s.concurrency, s.throughput_seconds, warmup_s=0.5)
            out[t.name].throughput.append(sat.rps)
            out[t.name].errors += sat.errors
            if sat.cpu_per_request_ms is not None:
                out[t.name].cpu_ms.append(sat.cpu_per_request_ms)
            cpu = f"  CPU {sat.cpu_per_request_ms:.4f} ms/req" if sat.cpu_per_request_ms is not None else ""
            print(f"# round {r + 1} {t.name:8s} {sat.rps:9.0f} req/s at concurrency {s.concurrency}{cpu}"
                  f"  errors {sat.errors}", file=sys.stderr, flush=True)
            await wait_idle(t)
    return out


class _NullBaselineFigure(Figure):
    """A figure whose baseline could not be measured: baseline and ratio print as null."""

    def json_line(self) -> str:
        d = json.loads(Figure(self.bench, self.metric, self.ours, 1.0, self.baseline_name, self.goal,
                              self.unit).json_line())
        d["baseline"] = d["ratio"] = None
        return json.dumps(d)


def _added(ours: list[float], direct: list[float]) -> float:
    return median([a - b for a, b in zip(ours, direct, strict=True)])


def run(settings: Settings | None = None) -> list[Figure]:
    s = settings or Settings()
    if not nginx_available():
        raise RuntimeError("nginx is needed for the node and the proxy_pass baseline (apt-get install nginx)")
    litellm_exe: Path | None = None
    litellm_reason = "disabled (--no-litellm)"
    if s.litellm:
        install = ensure_litellm()
        litellm_exe, litellm_reason = install.path, install.reason
        if litellm_exe is None:
            print(f"# LiteLLM unavailable, its figures are null: {litellm_reason}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        node = stack.enter_context(chat_node(work / "node"))
        proxy = stack.enter_context(nginx_proxy(work / "nginx", node.port))
        router = stack.enter_context(router_process(work / "router", node.url, dict(s.router_env)))
        router_url = router.url
        targets = [make_target("direct", node.url, "none"), make_target("router", router_url, TENANT_KEY, router.pid),
                   make_target("nginx", proxy.url, "none", proxy.pid)]
        urls = {"direct": node.url, "router": router_url, "nginx": proxy.url}
        if litellm_exe is not None:
            litellm = stack.enter_context(
                LiteLLMProxy(litellm_exe, work / "litellm", model=MODEL, api_base=node.url + "/v1"))
            targets.append(make_target("litellm", litellm.url, litellm.master_key, litellm.pid))
            urls["litellm"] = litellm.url
        for t in targets:
            key = {"router": TENANT_KEY, "litellm": "sk-meridian-bench"}.get(t.name, "none")
            _check(t, urls[t.name], {"authorization": f"Bearer {key}"})
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            figs = runner.run(_measure(targets, s))

    for name, f in figs.items():
        cpu = f"  CPU {median(f.cpu_ms):.4f} ms/req" if f.cpu_ms else ""
        print(f"# {name:8s} p50 {median(f.p50_ms):8.3f} ms  p99 {median(f.p99_ms):8.3f} ms  "
              f"max {median(f.throughput):8.0f} req/s{cpu}  errors {f.errors}/{f.sent}  unanswered {f.unanswered}",
              file=sys.stderr, flush=True)
    if figs["router"].errors:
        raise AssertionError(f"the router failed {figs['router'].errors} requests")
    direct, router, nginx = figs["direct"], figs["router"], figs["nginx"]
    added_p50 = _added(router.p50_ms, direct.p50_ms)
    added_p99 = _added(router.p99_ms, direct.p99_ms)
    rate = f"at {s.rate:g} req/s"
    out: list[Figure] = [
        Figure(BENCH, "added_p50_ms", added_p50, _added(nginx.p50_ms, direct.p50_ms),
               f"nginx proxy_pass added p50 {rate}", "<= 0.25", "ms"),
        Figure(BENCH, "added_p99_ms", added_p99, _added(nginx.p99_ms, direct.p99_ms),
               f"nginx proxy_pass added p99 {rate}", "<= 5", "ms"),
        Figure(BENCH, "throughput_vs_nginx", median(router.throughput), median(nginx.throughput),
               f"nginx proxy_pass max req/s (concurrency {s.concurrency})", "reported", "req/s"),
        # The product figure: CPU is what a router costs to run (the Rust routers: 6-12x nginx).
        Figure(BENCH, "cpu_per_request_vs_nginx", median(router.cpu_ms), median(nginx.cpu_ms),
               f"nginx proxy_pass CPU per request at saturation (concurrency {s.concurrency})", "ratio <= 12", "ms"),
    ]
    lite = figs.get("litellm")
    # Every round must have answers (a proxy failing every request of a round has no latency).
    if lite is not None and len(lite.p99_ms) == len(direct.p99_ms) and lite.throughput:
        out += [
            Figure(BENCH, "throughput_vs_litellm", median(router.throughput), median(lite.throughput),
                   f"LiteLLM proxy max req/s (concurrency {s.concurrency})", ">= 1", "req/s"),
            Figure(BENCH, "added_p99_vs_litellm", added_p99, _added(lite.p99_ms, direct.p99_ms),
                   f"LiteLLM proxy added p99 {rate}" + (
                       f" (a lower bound: {lite.unanswered} of {lite.sent} unanswered {DRAIN_S:g} s after"
                       " the last request)" if lite.unanswered else ""), "<= 1", "ms"),
        ]
    else:
        why = litellm_reason or "no answers"
        out += [
            _NullBaselineFigure(BENCH, "throughput_vs_litellm", median(router.throughput), math.nan,
                                f"LiteLLM proxy: not measured ({why})", ">= 1", "req/s"),
            _NullBaselineFigure(BENCH, "added_p99_vs_litellm", added_p99, math.nan,
                                f"LiteLLM proxy: not measured ({why})", "<= 1", "ms"),
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop request rate (req/s)")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per path and round")
    ap.add_argument("--rounds", type=int, default=None, help="latency rounds (each path once per round)")
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop connections for max throughput")
    ap.add_argument("--full", action="store_true", help="5 rounds of 10 s, 3 throughput rounds of 5 s")
    ap.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (its figures print as null)")
    ap.add_argument("--router-env", action="append", default=[], metavar="MERIDIAN_X=V",
                    help="a setting for the router process (repeatable), e.g. MERIDIAN_ROUTER_ACCESS_LOG=false")
    args = ap.parse_args()
    router_env = tuple(tuple(kv.split("=", 1)) for kv in args.router_env)
    if any(len(kv) != 2 or not kv[0].startswith("MERIDIAN_") for kv in router_env):
        ap.error("--router-env takes MERIDIAN_NAME=value")
    s = Settings(rate=args.rate, concurrency=args.concurrency, litellm=not args.no_litellm,
                 router_env=router_env)  # type: ignore[arg-type]
    if args.full:
        s = replace(s, seconds=10.0, rounds=5, throughput_seconds=5.0, throughput_rounds=3)
    if args.seconds is not None:
        s = replace(s, seconds=args.seconds)
    if args.rounds is not None:
        s = replace(s, rounds=args.rounds)
    for fig in run(s):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
