"""Flow control under saturation: a noisy neighbour, fair shares, weights, a priority band and
two routers, each against the same load sent through a router without flow control.

    python -m bench.flow_control [--seconds S] [--runs alone,flood,flood_off,...] [--repeats N]

One local fabric: a control plane and two torch-engine nodes in one region, each running at
most `slots` sequences at once (the fleet's capacity is 2 x slots streams), with a router
with flow control (the default), a router without it (MERIDIAN_ROUTER_FLOW_CONTROL=false) and
two more routers with it for the two-router run. Tenants are made through the admin API:
`flood` (A), `light` (B), `first`, `second`, `third` (the fairness runs, weights set per
run) and `urgent` (priority 5). Every run is closed-loop for a fixed window after a warm-up:

- **alone**: B alone, a few users with a short think time (about 20% of the fleet): its TTFT
  p90 unloaded, the baseline of the noisy-neighbour and priority figures.
- **flood / flood_off**: A keeps 5 x the fleet's slots of long streams in flight (400-word
  prompts, 200 tokens), B as in `alone`; with and without flow control. B's TTFT p90, and
  every tenant's generated tokens per second (throughput).
- **fair / fair_off**: three tenants, each with 1.5 x the fleet's slots of streams in flight
  and prompts of 50, 200 and 400 words: Jain's index over the tokens (prompt + generated) each
  was served in the window. Every tenant stays backlogged: the weight-2 tenant of the next
  run, of the shortest prompts, needs three quarters of the slots for half the tokens, and
  with only the fleet's slots of users its requests, all of one length, ended in waves that
  emptied its queue for a moment each time (and gave its turn away: work-conserving).
- **weighted / weighted_off**: the same with weights 2:1:1: the largest relative error of a
  tenant's share against 2:1:1.
- **urgent**: A floods, `urgent` (band 5) sends B's light load: its TTFT p90 against `alone`.
- **full**: the engines' floor, without flow control: A keeps exactly the fleet's slots less
  B's users in flight, so every batch is full and B's requests never wait for a slot (at the
  router or a node). B's TTFT p90 there is what a request costs beside a full batch: the
  `*_vs_full_batch` figures divide by it, so what is left of a ratio above 1 is the wait the
  router (or a node's queue) added, and what `*_vs_alone` shows beyond it is the engine's
  step time with a full batch against an empty one.
- **shed**: A keeps 3 x the fleet's slots of streams in flight, `batch` (band -1, sheddable)
  2 x, through a router whose queue holds at most the fleet's slots of requests: A alone
  never fills it, the two do. Of the requests refused (503 queue_full: shed from the queue
  for a more urgent arrival, or not queued), the share that were not batch's: 0 when the
  sheddable band is shed first; a drop blind to bands would refuse A's in proportion to
  what it sent. A refused client waits a second before it sends again.
- **two**: `flood` through two routers with flow control, every request to either at random,
  sharing their work counters and their requests running through Redis (`--redis`, the
  local one by default; without one answering, the two routers each count alone and the log
  says so).

Tokens served are counted as they are served: a prompt's (its usage, stream_options.include_usage)
at its first token, each generated token as it arrives, when that is inside the window.
TTFT is the client's: request sent to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.common import Figure, percentile
from data_plane.model.make_tiny import make_tiny_checkpoint
from localfabric import FabricSpec, LocalFabric, local_fabric
from meridian.admin_api import ApiKeyCreate, Scope, TenantCreate, TenantPatch
from meridian.admin_client import AdminClient
from meridian.contracts import HEADER_QUEUE_WAIT_MS

BENCH = "flow_control"
REGION = "aws:us-east-1"
MODEL = "bench-llama"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
         "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
# Each tenant's priority band (the tenants not named here are in band 0); `batch`'s is
# sheddable (below meridian.contracts.SHEDDABLE_BELOW).
BANDS = {"urgent": 5, "batch": -1}
TENANTS = ("flood", "light", "first", "second", "third", "urgent", "batch")
# A refused client waits this long before it sends again (the router's Retry-After is at
# least a second): without it, a refused client's loop would be a flood of its own.
RETRY_S = 1.0
# A little over the routers' probe interval (probe_interval_s, 1 s): after it every router has
# read each node's load afresh.
PROBE_SETTLE_S = 1.5


@dataclass(frozen=True, slots=True)
class Load:
    slots: int = 16  # per node; the fleet's capacity is twice this
    seconds: float = 20.0  # each run's measured window
    warmup_s: float = 6.0
    flood_words: int = 400
    flood_tokens: int = 200
    light_users: int = 3
    light_words: int = 40
    light_tokens: int = 16
    light_think_s: float = 0.3
    fair_words: tuple[int, ...] = (50, 200, 400)
    fair_tokens: int = 64
    reserve_share: float | None = None  # the routers' flow_reserve_share (None: their default)
    redis_url: str | None = "redis://127.0.0.1:6379/0"  # the two routers' shared state


@dataclass
class Tally:
    """What the clients of one run saw, per tenant: TTFTs and tokens served in the window."""

    ttfts: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # Of those, the time the router held the request for room (x-meridian-queue-wait-ms).
    queued: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # Prompt and generated tokens served in the window (each counted as it is served).
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    generated: int = 0
    # The prompt tokens of each tenant's last answer (its prompts are all about one length).
    prompt_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Generated tokens per chunk of text in each tenant's last answer.
    per_chunk: dict[str, float] = field(default_factory=lambda: defaultdict(lambda: 1.0))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Requests sent in the window, and of those, refused (503 queue_full: shed or not queued).
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    window: tuple[float, float] = (0.0, 0.0)

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t <= self.window[1]


def log(msg: str) -> None:
    print(f"[bench.flow_control] {msg}", file=sys.stderr, flush=True)


def _prompt(rng: random.Random, words: int) -> str:
    return f"[{rng.random():.12f}] " + " ".join(rng.choice(WORDS) for _ in range(words))


async def _stream(http: httpx.AsyncClient, url: str, key: str, prompt: str, max_tokens: int,
                  tenant: str, tally: Tally) -> bool:
    """One streamed chat request: its TTFT (when it is sent in the window) and the tokens it
    was served in the window, each when it was served: the prompt's at the first token (its
    prefill is done), each generated token as it arrives.

    Counted as served, not as a request ends: a tenant of 400-word prompts has a request's
    worth of work in each of its streams running, and whether those end just inside or just
    outside a 20 s window moved its share by a tenth from one round to the next.

    False when it was refused or failed."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    sent = time.perf_counter()
    first: float | None = None
    prompt_tokens: int | None = None
    chunks: list[float] = []  # when each chunk of generated text came
    if tally.in_window(sent):
        tally.sent[tenant] += 1
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                refusal = await r.aread()
                if r.status_code == 503 and b"queue_full" in refusal and tally.in_window(sent):
                    tally.refused[tenant] += 1
                tally.errors[tenant] += 1
                return False
            queued_s = float(r.headers.get(HEADER_QUEUE_WAIT_MS, "0")) / 1000
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if first is None:  # the role chunk, sent with the first token
                    first = now
                    if tally.in_window(sent):
                        tally.ttfts[tenant].append(first - sent)
                        tally.queued[tenant].append(queued_s)
                if usage := chunk.get("usage"):  # the last: the request's usage, no token
                    prompt_tokens = int(usage.get("prompt_tokens", 0))
                    tally.prompt_tokens[tenant] = prompt_tokens
                    if chunks:
                        tally.per_chunk[tenant] = int(usage.get("completion_tokens", 0)) / len(chunks)
                elif chunk.get("choices") and "role" not in chunk["choices"][0]["delta"]:
                    chunks.append(now)
    except httpx.HTTPError:
        tally.errors[tenant] += 1
        return False
    finally:
        _count_served(tally, tenant, first, prompt_tokens, chunks)
    return True


def _count_served(tally: Tally, tenant: str, first: float | None, prompt_tokens: int | None,
                  chunks: list[float]) -> None:
    """What one stream was served inside the window. A chunk is not always one token (a token
    of half a character sends none; the finish has its own), so chunks count as the tokens
    per chunk of the tenant's last whole answer; a stream the window's end cut off counts its
    prompt as that answer's."""
    if first is not None and tally.in_window(first):
        tally.tokens[tenant] += prompt_tokens if prompt_tokens is not None else tally.prompt_tokens[tenant]
    generated = round(sum(1 for t in chunks if tally.in_window(t)) * tally.per_chunk[tenant])
    tally.tokens[tenant] += generated
    tally.generated += generated


@dataclass(frozen=True, slots=True)
class Clients:
    """One tenant's closed-loop clients in a run."""

    tenant: str
    users: int
    words: int
    tokens: int
    think_s: float = 0.0


async def _run(urls: list[str], keys: dict[str, str], clients: list[Clients], load: Load) -> Tally:
    """The clients against `urls` (each request to one at random) for the warm-up and window."""
    tally = Tally()
    start = time.perf_counter()
    tally.window = (start + load.warmup_s, start + load.warmup_s + load.seconds)
    stop_at = tally.window[1]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)

    async def user(http: httpx.AsyncClient, c: Clients, seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < stop_at:
            if not await _stream(http, rng.choice(urls), keys[c.tenant], _prompt(rng, c.words), c.tokens,
                                 c.tenant, tally):
                await asyncio.sleep(RETRY_S)
            elif c.think_s:
                await asyncio.sleep(rng.expovariate(1 / c.think_s))

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as http:
        users = [user(http, c, hash((c.tenant, i))) for c in clients for i in range(c.users)]
        tasks = [asyncio.ensure_future(u) for u in users]
        await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
        # The window is over: what still runs (a flood's backlog) is cut off, not waited for.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tally


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one gets everything."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def share_error(served: list[float], weights: list[float]) -> float:
    """The largest relative error of a share against its weight's share."""
    total, wsum = sum(served), sum(weights)
    if not total:
        return 1.0
    return max(abs((s / total) / (w / wsum) - 1) for s, w in zip(served, weights, strict=True))


async def _routing_versions(routers: dict[str, list[str]]) -> dict[str, int]:
    """Each router's routing-table version now (its /health says)."""
    async with httpx.AsyncClient(timeout=5) as http:
        return {url: (await http.get(f"{url}/health")).json()["routing_version"]
                for urls in routers.values() for url in urls}


async def _weights_in_tables(fabric: LocalFabric, routers: dict[str, list[str]], weights: dict[str, float]) -> None:
    """Until the control plane's routing table gives the tenants `weights` and every router
    has loaded that table or a newer one. A tenant's new weight reaches a router by its
    long-poll. Waiting for any newer table than the routers had was not enough: on a fresh
    fabric the table's version moves for other reasons (nodes coming up), the wait ended on
    one of those, and the first weighted round of a fabric measured 2:1:1 as 1:1:1 (every
    outlier round of the weighted share error, 0.22-0.71, was a fabric's first)."""
    info = fabric.info
    assert info is not None
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(120):
            r = await http.get(f"{info.control_plane_url}/v1/routing-table",
                               headers={"authorization": f"Bearer {info.cluster_token}"})
            table = r.json()
            have = {t["tenant"]: float(t.get("weight", 1.0)) for t in table["tenants"] if t["tenant"] in weights}
            if have == weights:
                break
            await asyncio.sleep(0.25)
        else:
            raise RuntimeError(f"the control plane's table did not give the weights {weights} within 30 s")
    for _ in range(120):
        if all(v >= table["version"] for v in (await _routing_versions(routers)).values()):
            return
        await asyncio.sleep(0.25)
    raise RuntimeError("the routers did not load the new routing table within 30 s")


async def _drain(fabric: LocalFabric) -> None:
    """Until the nodes run nothing (a cut-off flood's requests end or are aborted)."""
    token = fabric.info.cluster_token if fabric.info else ""
    async with httpx.AsyncClient(timeout=5) as http:
        for _ in range(120):
            busy = 0.0
            for p in fabric.node_processes:
                r = await http.get(f"{p.url}/metrics", headers={"authorization": f"Bearer {token}"})
                for line in r.text.splitlines():
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                        busy += float(line.rsplit(" ", 1)[1])
            if not busy:
                # And until every router has probed them idle: a run that starts on a report of
                # the last run's load sees the pool full, queues its first arrivals and, its
                # queue at its cap, refuses some (the shedding run refused 15 of A's at its start).
                await asyncio.sleep(PROBE_SETTLE_S)
                return
            await asyncio.sleep(0.5)
    log("the nodes did not drain within 60 s")


def _light(tenant: str, load: Load) -> Clients:
    return Clients(tenant, load.light_users, load.light_words, load.light_tokens, load.light_think_s)


def _flood(load: Load) -> Clients:
    return Clients("flood", 5 * 2 * load.slots, load.flood_words, load.flood_tokens)


def _full(load: Load) -> Clients:
    """A's streams that fill the fleet's batches beside B's users and no more."""
    return Clients("flood", 2 * load.slots - load.light_users, load.flood_words, load.flood_tokens)


def _shed(load: Load) -> list[Clients]:
    """A's streams, more than the fleet's slots but fewer waiting than the queue's cap, and
    `batch` (sheddable) with as many again: only batch's requests may be refused."""
    return [Clients("flood", 3 * load.slots, load.flood_words, load.flood_tokens),
            Clients("batch", 2 * load.slots, load.flood_words, load.flood_tokens)]


def _fair(load: Load) -> list[Clients]:
    names = ("first", "second", "third")
    return [Clients(n, 3 * load.slots, w, load.fair_tokens) for n, w in zip(names, load.fair_words, strict=True)]


@dataclass
class Bench:
    fabric: LocalFabric
    routers: dict[str, list[str]]
    keys: dict[str, str]
    admin: Callable[[], AdminClient]
    load: Load
    tallies: dict[str, Tally] = field(default_factory=dict)

    async def measure(self, name: str, router: str, clients: list[Clients],
                      before: Callable[[], dict[str, float]] | None = None) -> None:
        if before is not None:
            await _weights_in_tables(self.fabric, self.routers, before())
        tally = await _run(self.routers[router], self.keys, clients, self.load)
        await _drain(self.fabric)
        self.tallies[name] = tally
        p90 = {t: round(percentile(v, 0.9) * 1000, 1) for t, v in tally.ttfts.items() if v}
        held = {t: round(percentile(v, 0.9) * 1000, 1) for t, v in tally.queued.items() if v}
        log(f"{name:12s} TTFT p90 ms {p90} (held at the router, p90 ms {held}), tokens {dict(tally.tokens)}, generated/s "
            f"{tally.generated / self.load.seconds:.0f}, errors {dict(tally.errors)}")

    def weights(self, w: tuple[float, float, float]) -> Callable[[], dict[str, float]]:
        """Set the fairness tenants' weights; returns them, by tenant."""
        def apply() -> dict[str, float]:
            wanted = dict(zip(("first", "second", "third"), w, strict=True))
            with self.admin() as admin:
                for name, weight in wanted.items():
                    if admin.tenant(name).weight != weight:
                        admin.update_tenant(name, TenantPatch(weight=weight))
            return wanted
        return apply


RUNS: dict[str, Callable[[Bench], Awaitable[None]]] = {
    "alone": lambda b: b.measure("alone", "on", [_light("light", b.load)]),
    "flood": lambda b: b.measure("flood", "on", [_flood(b.load), _light("light", b.load)]),
    "flood_off": lambda b: b.measure("flood_off", "off", [_flood(b.load), _light("light", b.load)]),
    "fair": lambda b: b.measure("fair", "on", _fair(b.load), b.weights((1, 1, 1))),
    "fair_off": lambda b: b.measure("fair_off", "off", _fair(b.load)),
    "weighted": lambda b: b.measure("weighted", "on", _fair(b.load), b.weights((2, 1, 1))),
    "weighted_off": lambda b: b.measure("weighted_off", "off", _fair(b.load)),
    "urgent": lambda b: b.measure("urgent", "on", [_flood(b.load), _light("urgent", b.load)]),
    "two": lambda b: b.measure("two", "two", [_flood(b.load), _light("light", b.load)]),
    "full": lambda b: b.measure("full", "off", [_full(b.load), _light("light", b.load)]),
    "shed": lambda b: b.measure("shed", "capped", _shed(b.load)),
}


def _p90(b: Bench, run: str, tenant: str) -> float:
    return percentile(b.tallies[run].ttfts[tenant], 0.9) * 1000


def _fair_tokens(b: Bench, run: str) -> list[float]:
    return [float(b.tallies[run].tokens[t]) for t in ("first", "second", "third")]


def _figures(b: Bench) -> list[Figure]:
    have, out = b.tallies.keys(), []
    if {"flood", "alone"} <= have:
        out.append(Figure(BENCH, "noisy_neighbour_ttft_p90_vs_alone", _p90(b, "flood", "light"),
                          _p90(b, "alone", "light"), "B alone", "ratio <= 1.3 (B's TTFT p90, A at 5x capacity)", "ms"))
    if {"flood_off", "alone"} <= have:
        out.append(Figure(BENCH, "noisy_neighbour_ttft_p90_vs_alone_without_flow_control",
                          _p90(b, "flood_off", "light"), _p90(b, "alone", "light"), "B alone",
                          "context: what flow control removes", "ms"))
    if {"flood", "flood_off"} <= have:
        out.append(Figure(BENCH, "throughput_vs_no_flow_control", b.tallies["flood"].generated / b.load.seconds,
                          b.tallies["flood_off"].generated / b.load.seconds, "no flow control",
                          "ratio >= 0.95 (generated tokens/s)", "tokens/s"))
    if {"fair", "fair_off"} <= have:
        out.append(Figure(BENCH, "jain_index", jain(_fair_tokens(b, "fair")), jain(_fair_tokens(b, "fair_off")),
                          "no flow control", "ours >= 0.95 (tokens served, 3 tenants, 50/200/400-word prompts)",
                          "index"))
    if {"weighted", "weighted_off"} <= have:
        out.append(Figure(BENCH, "weighted_share_error", share_error(_fair_tokens(b, "weighted"), [2, 1, 1]),
                          share_error(_fair_tokens(b, "weighted_off"), [2, 1, 1]), "no flow control",
                          "ours <= 0.10 (largest relative error of a share against 2:1:1)", "ratio"))
    if {"urgent", "alone"} <= have:
        out.append(Figure(BENCH, "high_band_ttft_p90_vs_unloaded", _p90(b, "urgent", "urgent"),
                          _p90(b, "alone", "light"), "the same load unloaded",
                          "ratio <= 1.2 (band 5 beside A at 5x capacity)", "ms"))
    if {"two", "alone"} <= have:
        out.append(Figure(BENCH, "two_routers_noisy_neighbour_ttft_p90_vs_alone", _p90(b, "two", "light"),
                          _p90(b, "alone", "light"), "B alone",
                          "ratio <= 1.3 (two routers, each request to either)", "ms"))
    if "shed" in have:
        t = b.tallies["shed"]
        refused, sent = sum(t.refused.values()), sum(t.sent.values())
        out.append(Figure(BENCH, "refused_outside_the_sheddable_band",
                          (refused - t.refused["batch"]) / max(refused, 1), (sent - t.sent["batch"]) / max(sent, 1),
                          "a drop blind to bands (band 0's share of the requests sent)",
                          "ours = 0 (the queue at its cap: only the sheddable band refused)", "share"))
    for run, tenant, name in (("flood", "light", "noisy_neighbour"), ("urgent", "urgent", "high_band"),
                              ("two", "light", "two_routers_noisy_neighbour")):
        if {run, "full"} <= have:
            out.append(Figure(BENCH, f"{name}_ttft_p90_vs_full_batch", _p90(b, run, tenant), _p90(b, "full", "light"),
                              "B beside full batches, nothing waiting (the engines' floor)",
                              "context: near 1 when the router adds no wait beyond the engine's", "ms"))
    return out


def _fabric_spec(tmp: Path, load: Load) -> FabricSpec:
    model_dir = make_tiny_checkpoint(tmp / MODEL, seed=0)
    return FabricSpec(
        work_dir=tmp / "fabric", regions=(REGION,), model_name=MODEL, model_dir=model_dir,
        nodes_per_region=2, default_client_location=REGION,
        node_env={"MERIDIAN_NODE_MAX_NUM_SEQS": str(load.slots), "MERIDIAN_NODE_MAX_MODEL_LEN": "2048"},
    )


def _tenants(fabric: LocalFabric) -> tuple[dict[str, str], Callable[[], AdminClient]]:
    info = fabric.info
    assert info is not None

    def admin() -> AdminClient:
        return AdminClient(info.control_plane_url, info.admin_key, 10.0)

    keys = {}
    with admin() as a:
        for name in TENANTS:
            a.create_tenant(TenantCreate(name=name, priority=BANDS.get(name, 0)))
            keys[name] = a.create_key(ApiKeyCreate(name=name, tenant=name, scopes=[Scope.INFERENCE])).key
    return keys, admin


def _shared(load: Load) -> dict[str, str]:
    """The two routers' environment for sharing through Redis (empty when none answers)."""
    if load.redis_url is None:
        return {}
    try:
        with redis.Redis.from_url(load.redis_url, socket_timeout=2) as client:
            client.ping()
    except redis.RedisError as exc:
        log(f"Redis at {load.redis_url} does not answer ({exc}): the two routers count alone")
        return {}
    return {"MERIDIAN_ROUTER_REDIS_URL": load.redis_url, "MERIDIAN_ROUTER_FLEET_KEY_PREFIX": f"bench-flow-{os.getpid()}:"}


def _capped(load: Load) -> dict[str, str]:
    """A router whose queue holds at most the fleet's slots of requests (the shedding run)."""
    return {"MERIDIAN_ROUTER_FLOW_QUEUE_MAX_ENTRIES": str(2 * load.slots)}


def median_figures(rounds: list[list[Figure]]) -> list[Figure]:
    """Per metric, the figure of the round whose ratio is the median (the lower of the two
    middle ones for an even count): a round's ours and baseline stay together, measured in
    the same window of the same box."""
    by_metric: dict[str, list[Figure]] = defaultdict(list)
    for figures in rounds:
        for fig in figures:
            by_metric[fig.metric].append(fig)
    out = []
    for metric, figs in by_metric.items():
        ranked = sorted(figs, key=lambda f: f.ratio)
        log(f"{metric}: ratios {[round(f.ratio, 3) for f in figs]}")
        out.append(ranked[(len(ranked) - 1) // 2])
    return out


def run(load: Load = Load(), only: frozenset[str] | None = None, repeats: int = 1) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp, local_fabric(_fabric_spec(Path(tmp), load), on_step=log) as fabric:
        keys, admin = _tenants(fabric)
        on = {"MERIDIAN_ROUTER_FLOW_RESERVE_SHARE": str(load.reserve_share)} if load.reserve_share is not None else {}
        routers = {"on": [fabric.start_router(on).url],
                   "off": [fabric.start_router({"MERIDIAN_ROUTER_FLOW_CONTROL": "false"}).url],
                   "two": [fabric.start_router({**on, **_shared(load)}).url for _ in range(2)],
                   "capped": [fabric.start_router({**on, **_capped(load)}).url]}
        time.sleep(3.0)  # the routers' first probes read the nodes' load
        rounds = []
        for n in range(repeats):
            if repeats > 1:
                log(f"round {n + 1} of {repeats}")
            bench = Bench(fabric, routers, keys, admin, load)

            async def measure_all(bench: Bench = bench) -> None:
                for name, measure in RUNS.items():
                    if only is None or name in only:
                        await measure(bench)

            asyncio.run(measure_all())
            rounds.append(_figures(bench))
    return median_figures(rounds)


def main() -> None:
    defaults = Load()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=defaults.seconds, help="each run's measured window")
    ap.add_argument("--slots", type=int, default=defaults.slots, help="sequences per node")
    ap.add_argument("--reserve", type=float, default=None, help="the routers' flow_reserve_share")
    ap.add_argument("--redis", default=defaults.redis_url, help="the two routers' Redis ('' for none)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which runs ({', '.join(RUNS)})")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every run; each figure the median round's")
    args = ap.parse_args()
    load = Load(slots=args.slots, seconds=args.seconds, reserve_share=args.reserve, redis_url=args.redis or None)
    for fig in run(load, frozenset(args.runs.split(",")), max(1, args.repeats)):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
