"""Routing quality: KV-aware routing (the `affinity` policy) against round robin on a
multi-turn chat workload, and against least-load on a workload with no shared prefixes.

    python -m bench.routing [--full] [--repeats N] [--runs rr,aff,two,aff_unique,ll_unique]

One local fabric: a control plane, four torch-engine nodes in one region publishing KV
events, each with a KV cache that holds its share of the live conversations but not all
of them, and one router process per policy, all reading the same routing table; two more
affinity routers share Redis and get each turn at random (two routers vs one). Every
policy gets its own copy of the workload with different words (a per-run salt), so no
run finds another's KV blocks in the nodes' caches. Chat workload: users share a few
system prompts and hold conversations that grow a turn at a time (the assistant's answer
and a new user message appended each turn, after a think time), streamed so that time to first token is
measured at the client. Hit rate is what the nodes themselves report
(`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, summed over nodes, before and
after the run); load balance is requests per node as the router's `x-meridian-node`
header tells.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import Figure
from bench.engine import BENCH_ARCH
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from localfabric import FabricSpec, LocalFabric, local_fabric
from meridian.contracts import HEADER_NODE

BENCH = "routing"
REGION = "aws:us-east-1"
MODEL = "bench-llama"
# The engine bench's checkpoint: big enough that prefill dominates time to first token on a CPU.
ARCH = BENCH_ARCH
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue amber "
    "river mountain cloud stone market harbor engine signal vector matrix orbit canyon meadow"
).split()


@dataclass(frozen=True, slots=True)
class Workload:
    nodes: int = 4
    users: int = 12  # concurrent clients, each holding one conversation at a time
    conversations: int = 12
    turns: int = 6
    system_prompts: int = 2
    system_words: int = 12
    user_words: int = 40  # about 175 tokens a turn with the template
    max_tokens: int = 4
    think_s: float = 3.0  # mean (exponential) time a user takes between turns
    unique_requests: int = 64  # no-shared-prefix workload
    unique_words: int = 200
    # Each node's paged KV cache, in tokens. Production nodes are cache-bound: the fleet
    # together holds every live conversation (12 x ~1100 tokens at the last turn, so ~3300
    # a node when each lives on one) but one node does not, which is the case KV-aware
    # routing exists for. Round robin copies conversations onto every node and evicts.
    cache_tokens_per_node: int = 4096
    # The generated model (None: this bench's ARCH; bench.gpu_proof passes a bigger one, whose
    # prefill costs a GPU real time).
    arch: TinyArch | None = None


QUICK = Workload()
FULL = Workload(users=24, conversations=48, unique_requests=160, cache_tokens_per_node=8192)


def kv_cache_bytes(arch: TinyArch, tokens: int, dtype_bytes: int = 4) -> int:
    """Node setting (MERIDIAN_NODE_KV_CACHE_MEMORY_BYTES) for a KV cache of `tokens` tokens."""
    head_dim = arch.hidden_size // arch.num_attention_heads
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * head_dim * dtype_bytes * tokens


@dataclass
class RunResult:
    policy: str
    ttfts: list[float] = field(default_factory=list)
    per_node: Counter[str] = field(default_factory=Counter)
    hits: float = 0.0
    queries: float = 0.0
    errors: int = 0
    moves: int = 0  # turns served by another node than the conversation's previous turn

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttfts) if self.ttfts else float("nan")

    def max_over_mean(self, nodes: int) -> float:
        counts = [self.per_node.get(n, 0) for n in self.per_node] + [0] * max(0, nodes - len(self.per_node))
        mean = sum(counts) / nodes
        return max(counts) / mean if mean else float("inf")


def log(msg: str) -> None:
    print(f"[bench.routing] {msg}", file=sys.stderr, flush=True)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _node_cache_counters(
    http: httpx.AsyncClient, node_urls: list[str], token: str
) -> tuple[float, float]:
    """Sum of prefix-cache hits and queries (tokens) the nodes report."""
    hits = queries = 0.0
    for url in node_urls:
        r = await http.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"})
        r.raise_for_status()
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


async def _chat(
    http: httpx.AsyncClient,
    url: str,
    key: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    result: RunResult,
) -> tuple[str, str]:
    """One streamed chat turn; records TTFT and the serving node; returns the answer and the node."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    async with http.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as r:
        if r.status_code != 200:
            await r.aread()
            result.errors += 1
            return "", ""
        node = r.headers.get(HEADER_NODE, "?")
        result.per_node[node] += 1
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    if ttft is not None:
        result.ttfts.append(ttft)
    return "".join(text), node


async def chat_workload(urls: list[str], key: str, w: Workload, salt: int, result: RunResult) -> None:
    """Users working through conversations that share system prompts and grow turn by turn;
    with several router URLs each turn goes to one picked at random, as a client-side
    balancer in front of N routers would send it."""
    rng = random.Random(salt)
    systems = [f"[{salt}] " + _words(rng, w.system_words) for _ in range(w.system_prompts)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(w.conversations):
        queue.put_nowait(i)

    async def user(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            conv = queue.get_nowait()
            crng = random.Random(salt * 1000 + conv)
            messages = [{"role": "system", "content": systems[conv % len(systems)]}]
            last_node = ""
            for turn in range(w.turns):
                if turn:  # the user reads the answer and types the next message
                    await asyncio.sleep(crng.expovariate(1 / w.think_s))
                messages.append({"role": "user", "content": _words(crng, w.user_words)})
                url = urls[crng.randrange(len(urls))]
                answer, node = await _chat(http, url, key, messages, w.max_tokens, result)
                result.moves += bool(last_node) and node != last_node
                last_node = node
                messages.append({"role": "assistant", "content": answer})

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(user(http) for _ in range(w.users)))


async def unique_workload(urls: list[str], key: str, w: Workload, salt: int, result: RunResult) -> None:
    """Single-turn requests that share nothing: affinity has nothing to find."""
    rng = random.Random(salt)
    prompts = [f"[{salt}:{i}] " + _words(rng, w.unique_words) for i in range(w.unique_requests)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async def user(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            await _chat(http, urls[0], key, [{"role": "user", "content": prompt}], w.max_tokens, result)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(user(http) for _ in range(w.users)))


async def measure(
    fabric: LocalFabric,
    router_urls: list[str],
    policy: str,
    workload: Workload,
    salt: int,
    runner: Callable[..., object],
) -> RunResult:
    info = fabric.info
    assert info is not None
    node_urls = [p.url for p in fabric.node_processes]
    result = RunResult(policy)
    async with httpx.AsyncClient(timeout=10) as http:
        h0, q0 = await _node_cache_counters(http, node_urls, info.cluster_token)
        await runner(router_urls, info.keys["global"], workload, salt, result)  # type: ignore[misc]
        h1, q1 = await _node_cache_counters(http, node_urls, info.cluster_token)
    result.hits, result.queries = h1 - h0, q1 - q0
    log(
        f"{policy:12s} salt={salt}: hit rate {result.hit_rate:.3f}, mean TTFT {result.mean_ttft * 1000:.1f} ms, "
        f"requests per node {dict(sorted(result.per_node.items()))}, conversation moves {result.moves}, "
        f"errors {result.errors}"
    )
    return result


def _redis_url() -> str | None:
    """The Redis the two-router run shares, when one answers (MERIDIAN_BENCH_REDIS_URL)."""
    url = os.environ.get("MERIDIAN_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    parsed = urlsplit(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=1):
            return url
    except OSError:
        return None


# The runs, in the order they are measured: (name, router policy, workload).
RUNS: tuple[tuple[str, str, Callable[..., object]], ...] = (
    ("rr", "round-robin", chat_workload),
    ("aff", "affinity", chat_workload),
    ("two", "two routers", chat_workload),
    ("aff_unique", "affinity", unique_workload),
    ("ll_unique", "least-load", unique_workload),
)


@dataclass(frozen=True, slots=True)
class FigureSpec:
    """One reported figure: the median of `value` over run `ours` against run `base`."""

    metric: str
    ours: str
    base: str
    value: Callable[[RunResult, int], float]  # a run's figure, given the node count
    base_name: str
    goal: str
    unit: str


def _hit_rate(r: RunResult, nodes: int) -> float:
    return r.hit_rate


def _ttft_ms(r: RunResult, nodes: int) -> float:
    return r.mean_ttft * 1000


def _balance(r: RunResult, nodes: int) -> float:
    return r.max_over_mean(nodes)


FIGURES = (
    FigureSpec("hit_rate_vs_round_robin", "aff", "rr", _hit_rate, "round robin",
               "ratio >= 3 (prefix-cache hit rate the nodes report)", "ratio"),
    FigureSpec("mean_ttft_vs_round_robin", "aff", "rr", _ttft_ms, "round robin", "ratio <= 0.5", "ms"),
    FigureSpec("max_over_mean_load", "aff", "rr", _balance, "round robin",
               "ours <= 1.3 (requests per node, max / mean)", "ratio"),
    FigureSpec("mean_ttft_vs_least_load_no_shared_prefix", "aff_unique", "ll_unique", _ttft_ms, "least-load",
               "ratio <= 1.1 (no worse than least-load)", "ms"),
    FigureSpec("two_routers_hit_rate_vs_one", "two", "aff", _hit_rate, "one router",
               "ratio >= 0.9 (two routers sharing Redis, each turn to either at random)", "ratio"),
)


def _fabric_spec(tmp: Path, w: Workload) -> FabricSpec:
    """One region of `w.nodes` torch-engine nodes on the bench checkpoint, each KV cache
    sized to `w.cache_tokens_per_node`."""
    arch = w.arch or ARCH
    model_dir = make_tiny_checkpoint(tmp / MODEL, seed=0, arch=arch)
    return FabricSpec(
        work_dir=tmp / "fabric",
        regions=(REGION,),
        model_name=MODEL,
        model_dir=model_dir,
        nodes_per_region=w.nodes,
        default_client_location=REGION,
        node_env={
            "MERIDIAN_NODE_MAX_MODEL_LEN": "4096",
            "MERIDIAN_NODE_KV_CACHE_MEMORY_BYTES": str(kv_cache_bytes(arch, w.cache_tokens_per_node)),
        },
    )


def _start_routers(fabric: LocalFabric, redis_url: str | None) -> dict[str, list[str]]:
    """Router URLs by policy: one router each, and two affinity routers sharing Redis
    ("two routers") when a Redis answers."""
    routers = {
        p: [fabric.start_router({"MERIDIAN_ROUTER_ROUTING_POLICY": p}).url]
        for p in ("affinity", "round-robin", "least-load")
    }
    if redis_url is not None:
        shared = {
            "MERIDIAN_ROUTER_ROUTING_POLICY": "affinity",
            "MERIDIAN_ROUTER_REDIS_URL": redis_url,
            "MERIDIAN_ROUTER_FLEET_KEY_PREFIX": f"meridian:bench-routing:{os.getpid()}:",
        }
        routers["two routers"] = [fabric.start_router(shared).url for _ in range(2)]
    return routers


async def _measure_runs(
    fabric: LocalFabric,
    routers: dict[str, list[str]],
    w: Workload,
    repeats: int,
    only: frozenset[str] | None,
) -> dict[str, list[RunResult]]:
    """Every selected run whose routers exist, `repeats` times, by run name."""
    out: dict[str, list[RunResult]] = {}
    salt = 0
    for _ in range(repeats):
        # Every run gets fresh words (a new salt), so none finds another's blocks.
        for name, policy, runner in RUNS:
            if policy not in routers or (only is not None and name not in only):
                continue
            salt += 1
            out.setdefault(name, []).append(await measure(fabric, routers[policy], policy, w, salt, runner))
    return out


def _figures(runs: dict[str, list[RunResult]], nodes: int) -> list[Figure]:
    """The figures whose two runs were both measured, medians over the repeats."""

    def med(name: str, spec: FigureSpec) -> float:
        return statistics.median(spec.value(r, nodes) for r in runs[name])

    return [
        Figure(BENCH, spec.metric, med(spec.ours, spec), med(spec.base, spec), spec.base_name, spec.goal, spec.unit)
        for spec in FIGURES
        if spec.ours in runs and spec.base in runs
    ]


def run(full: bool = False, repeats: int = 1, only: frozenset[str] | None = None,
        workload: Workload | None = None) -> list[Figure]:
    """Start the fabric and its routers, measure the runs (`only` those named), and
    return the figures whose pairs were measured (`workload`: other sizes than quick's or full's)."""
    w = workload or (FULL if full else QUICK)
    redis_url = _redis_url()
    if redis_url is None:
        log("no Redis answers: the two-router run is left out")
    with tempfile.TemporaryDirectory() as tmp:
        with local_fabric(_fabric_spec(Path(tmp), w), on_step=log) as fabric:
            routers = _start_routers(fabric, redis_url)
            runs = asyncio.run(_measure_runs(fabric, routers, w, repeats, only))
    return _figures(runs, w.nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="more conversations and turns")
    ap.add_argument(
        "--runs",
        default="rr,aff,two,aff_unique,ll_unique",
        help="which runs (rr, aff, two, aff_unique, ll_unique); figures need their pairs",
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy; figures are medians")
    args = ap.parse_args()
    for fig in run(full=args.full, repeats=args.repeats, only=frozenset(args.runs.split(","))):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
