"""Migration: nodes serving long streams are SIGKILLed at a steady rate (issue 22).

    python -m bench.migration [--concurrency C] [--seconds S] [--kill-every S] [--max-tokens N]
                              [--restart-after S] [--rounds N] [--router-env MERIDIAN_X=V ...]

A local fabric with two torch-engine nodes (the tiny demo model) in each of two regions,
aws:us-east-1 (the clients' own) and aws:us-east-2. Clients keep `concurrency` long
greedy chat streams in flight (temperature 0, ignore_eos, `max_tokens` each, closed loop),
cycling through a fixed set of prompts, and ask `return_token_ids` so that every stream's
token ids can be compared with the reference: the same prompt streamed alone on an idle
fabric first (greedy decoding is deterministic, so any difference is the seam's fault).

The same load runs without faults for `seconds`/2, then `rounds` times: a crash phase of
`seconds` in which every `kill_every_s` the live node with the most streams in flight is
SIGKILLed (never the last one alive) and started again `restart_after_s` later (at a low
CPU priority until it is up: on separate machines its cold start would not take the
survivors' CPU), then `seconds`/2 without faults again, once the killed nodes are back.
No-fault time on both sides of the crashes: a shared machine's drift weighs on both alike.

- `broken_streams`: streams that ended with an error event, without `[DONE]`, or with no
  stream at all. Goal 0. Baseline: the same count without faults.
- `token_mismatches`: finished streams whose token ids differ from the reference. Goal 0.
  Baseline: the same without faults (batching alone must not change greedy ids).
  `text_mismatches` is the same for the text the client read.
- `resume_p50_ms` / `resume_p99_ms`: for each migration, the gap the client saw between
  the last token from the failed node and the first from the next (the router's journal
  says after how many tokens each continuation began). Baseline: the inter-token gap
  without faults, p50 / p99 over streams of each stream's mean gap (on shared cores a
  node's events reach the client in bursts, so single gaps are mostly ~0).
- `resume_p99_vs_itl`: each seam's gap over the median inter-token gap of the unmigrated
  streams that ran on the node that finished it during the crashes (same node, same load),
  p99. Baseline: an unbroken stream's largest gap over its node's median gap, p99, without
  faults: the worst hiccup a stream sees anyway.
- `throughput_under_crashes`: generated tokens per second received by all clients during
  the crash phases. Baseline: without faults. Reported: the cost of migration (re-prefill,
  the seams) and of the crashes themselves (a node's cold start shares these cores).
- `migrated_streams`: streams that carried the router's `meridian` field (migrations did
  happen, so the figures above measure something). Baseline: every crash-phase stream.

The router runs with its default settings unless `--router-env` says otherwise; its
migration metrics and where a seam's time goes are logged to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import Figure, percentile
from localfabric import DEMO_MODEL, FabricSpec, LocalFabric, Proc, local_fabric, renice
from meridian.contracts import HEADER_NODE, HEADER_REQUEST_ID

BENCH = "migration"
REGIONS = ("aws:us-east-1", "aws:us-east-2")
TOPICS = ("a lighthouse", "the sea", "a small robot", "winter", "a lost key", "the moon", "a baker",
          "an old map", "a river", "the last train", "a clockmaker", "a storm", "a garden",
          "a library", "a kite", "a mountain")
# A restarted node starts at this niceness and is raised to 0 once up (chaos.environment's rule).
COLD_START_NICENESS = 15


def log(msg: str) -> None:
    print(f"[bench.migration] {msg}", file=sys.stderr, flush=True)


# -- one stream, as a client sees it ------------------------------------------------------


@dataclass
class StreamResult:
    """What a client received: token ids and text, when each event came, how it ended."""

    prompt: int
    node: str = ""  # the node that started it (the router's header)
    status: int | None = None  # None: no HTTP answer at all
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of each event with tokens
    done: bool = False  # `[DONE]` came
    error: str | None = None  # an error event, or the transport's error
    migrations: int = 0
    final_node: str = ""  # the node that finished it (the `meridian` field; else `node`)
    request_id: str = ""  # the router's, which keys its journal
    sent: float = 0.0  # perf_counter when the request went out
    opened: float = 0.0  # perf_counter when the response's headers came
    token_at: list[float] = field(default_factory=list)  # when each generated token came
    resumed_at: list[int] = field(default_factory=list)  # per migration: tokens sent before it

    @property
    def broken(self) -> bool:
        return self.status != 200 or not self.done or self.error is not None

    @property
    def gaps(self) -> list[float]:
        """Inter-token gaps: between consecutive events that carried tokens."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def read_event(res: StreamResult, data: str, at: float) -> None:
    if data == "[DONE]":
        res.done = True
        return
    event: dict[str, Any] = json.loads(data)
    if "error" in event and "choices" not in event:
        res.error = json.dumps(event["error"])[:300]
        return
    if isinstance(moved := event.get("meridian"), dict):
        res.migrations = int(moved.get("migrations", 0))
        res.final_node = str(moved.get("node", ""))
    got = False
    for choice in event.get("choices") or ():
        ids = choice.get("token_ids") or []
        res.ids += ids
        res.token_at += [at] * len(ids)
        res.text.append((choice.get("delta") or {}).get("content") or "")
        got = got or bool(ids)
    if got:
        res.times.append(at)


def chat_body(prompt: int, max_tokens: int) -> dict[str, Any]:
    return {"model": DEMO_MODEL, "stream": True, "return_token_ids": True, "temperature": 0,
            "ignore_eos": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Tell me a long story about {TOPICS[prompt]}."}]}


async def stream_once(http: httpx.AsyncClient, url: str, key: str, prompt: int, max_tokens: int,
                      in_flight: dict[int, str] | None = None) -> StreamResult:
    """One chat stream of prompt number `prompt` through the router (see stream_chat)."""
    return await stream_chat(http, url, key, chat_body(prompt, max_tokens), prompt, in_flight)


async def stream_chat(http: httpx.AsyncClient, url: str, key: str, body: dict[str, Any], prompt: int = 0,
                      in_flight: dict[int, str] | None = None) -> StreamResult:
    """One chat stream of `body` through the router, as its client saw it; `in_flight` holds
    the node of each stream under way."""
    res = StreamResult(prompt, sent=time.perf_counter())
    token = object()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}) as r:
            res.status, res.node = r.status_code, r.headers.get(HEADER_NODE, "")
            res.request_id, res.opened = r.headers.get(HEADER_REQUEST_ID, ""), time.perf_counter()
            if in_flight is not None:
                in_flight[id(token)] = res.node
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    read_event(res, line[5:].strip(), time.perf_counter())
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        if in_flight is not None:
            in_flight.pop(id(token), None)
    res.final_node = res.final_node or res.node
    return res


# -- a phase of load ------------------------------------------------------------------------


@dataclass
class Phase:
    streams: list[StreamResult]
    seconds: float  # from the first stream sent to the last one ended
    kills: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(len(s.ids) for s in self.streams) / self.seconds if self.seconds else 0.0


async def run_load(url: str, key: str, *, concurrency: int, seconds: float, max_tokens: int,
                   in_flight: dict[int, str]) -> Phase:
    """Closed loop: `concurrency` clients each stream one prompt after another for `seconds`
    (the prompts in turn across all of them), and finish the stream they are in."""
    streams: list[StreamResult] = []
    turn = iter(range(1 << 30))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as http:
        start = time.perf_counter()

        async def client() -> None:
            while time.perf_counter() - start < seconds:
                prompt = next(turn) % len(TOPICS)
                streams.append(await stream_once(http, url, key, prompt, max_tokens, in_flight))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return Phase(streams, time.perf_counter() - start)


def merged(phases: list[Phase]) -> Phase:
    """Phases of one kind as one (tokens over their summed time)."""
    return Phase([s for p in phases for s in p.streams], sum(p.seconds for p in phases),
                 [k for p in phases for k in p.kills])


# -- faults ---------------------------------------------------------------------------------


def pick_victim(alive: list[str], in_flight: dict[int, str]) -> str | None:
    """The live node with the most streams in flight (ties: the first), None when killing it
    would leave no node to move to, or no node serves a stream."""
    if len(alive) < 2:
        return None
    load = Counter(node for node in in_flight.values() if node in alive)
    if not load:
        return None
    return max(alive, key=lambda n: load[n])


class Crasher:
    """SIGKILLs a node serving streams every `every_s`, and starts it again `restart_after_s`
    later (at a low priority until it answers /health: its cold start is not the fabric's load)."""

    def __init__(self, fabric: LocalFabric, in_flight: dict[int, str], every_s: float,
                 restart_after_s: float) -> None:
        self._fabric, self._in_flight = fabric, in_flight
        self._every_s, self._restart_after_s = every_s, restart_after_s
        self._down: set[str] = set()
        self._restarts: list[asyncio.Task[None]] = []
        self.kills: list[float] = []

    def _node(self, node_id: str) -> Proc:
        return next(p for p in self._fabric.node_processes if p.node_id == node_id)

    async def run(self, until: float) -> None:
        while (wait := min(self._every_s, until - time.perf_counter())) > 0:
            await asyncio.sleep(wait)
            if time.perf_counter() >= until:
                break
            alive = [p.node_id for p in self._fabric.node_processes
                     if p.node_id and p.node_id not in self._down and p.popen.poll() is None]
            victim = pick_victim(alive, self._in_flight)
            if victim is None:
                log(f"no node to kill now (alive: {alive}, in flight: {sorted(self._in_flight.values())})")
                continue
            proc = self._node(victim)
            proc.popen.send_signal(signal.SIGKILL)
            self.kills.append(time.perf_counter())
            self._down.add(victim)
            streams = sum(1 for n in self._in_flight.values() if n == victim)
            log(f"SIGKILL {victim} (about {streams} streams on it)")
            await asyncio.to_thread(proc.popen.wait, 30)
            self._restarts.append(asyncio.create_task(self._restart(victim)))

    async def _restart(self, node_id: str) -> None:
        await asyncio.sleep(self._restart_after_s)
        started = time.perf_counter()
        fresh = self._fabric.restart(self._node(node_id), niceness=COLD_START_NICENESS)
        try:
            await asyncio.to_thread(self._fabric.wait_ready, fresh, 120.0)
        finally:
            renice(fresh.popen.pid, 0)
        self._down.discard(node_id)
        log(f"{node_id} is back ({time.perf_counter() - started:.1f}s after its restart)")

    async def settle(self) -> None:
        """Wait for every restart, so the fabric is whole again."""
        await asyncio.gather(*self._restarts)


async def crash_phase(fabric: LocalFabric, url: str, key: str, *, concurrency: int, seconds: float,
                      max_tokens: int, kill_every_s: float, restart_after_s: float) -> Phase:
    in_flight: dict[int, str] = {}
    crasher = Crasher(fabric, in_flight, kill_every_s, restart_after_s)
    load = asyncio.create_task(run_load(url, key, concurrency=concurrency, seconds=seconds,
                                        max_tokens=max_tokens, in_flight=in_flight))
    await crasher.run(time.perf_counter() + seconds)
    phase = await load
    await crasher.settle()
    phase.kills = crasher.kills
    return phase


# -- the figures (pure) -----------------------------------------------------------------------


def seams(s: StreamResult) -> list[float]:
    """A migrated stream's gap at each seam, as its client saw it: from the last token of
    one node to the first of the next (the router's journal says after how many tokens
    each continuation began). Not its largest gaps: a stream also waits while others
    re-prefill on its node, or while a node's cold start takes the CPU."""
    out = []
    for k in s.resumed_at:
        if 0 < k < len(s.token_at):
            out.append(s.token_at[k] - s.token_at[k - 1])
        elif k == 0 and s.token_at:  # it broke before its first token
            out.append(s.token_at[0] - s.opened)
    return out


def since_kill(s: StreamResult, kills: list[float]) -> list[float]:
    """Per seam: from the last SIGKILL before it to the continuation's first token (the
    seam's client gap less the tokens still in flight from the dying node: the log's split)."""
    out = []
    for k in s.resumed_at:
        if k < len(s.token_at) and (before := [t for t in kills if t <= s.token_at[k]]):
            out.append(s.token_at[k] - before[-1])
    return out


def read_seams(journal: Path, streams: list[StreamResult]) -> None:
    """Fill each stream's `resumed_at` from the router's journal (its continuation lines)."""
    resumed: dict[str, list[int]] = {}
    for line in journal.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("type") == "routed" and rec.get("migration"):
                resumed.setdefault(rec["key"], []).append(int(rec["resume_tokens"]))
    for s in streams:
        s.resumed_at = resumed.get(s.request_id, [])


def itl(s: StreamResult) -> float | None:
    """A stream's mean inter-token gap. Not a single gap: on shared cores a node's events
    reach the client in bursts, so most single gaps are ~0 and the rest a burst's wait."""
    return (s.times[-1] - s.times[0]) / (len(s.times) - 1) if len(s.times) > 1 else None


def unbroken_itls(streams: list[StreamResult]) -> list[tuple[str, float]]:
    """(node, mean inter-token gap) of every stream that ran on one node from start to end."""
    return [(s.node, g) for s in streams if s.migrations == 0 and not s.broken and (g := itl(s)) is not None]


def node_itl(streams: list[StreamResult]) -> dict[str, float]:
    """The median inter-token gap of the unmigrated streams of each node."""
    by_node: dict[str, list[float]] = {}
    for node, g in unbroken_itls(streams):
        by_node.setdefault(node, []).append(g)
    return {n: statistics.median(g) for n, g in by_node.items()}


def seam_ratios(streams: list[StreamResult]) -> list[float]:
    """Each seam's gap over the inter-token gap of unmigrated streams on the node that finished it."""
    per_node = node_itl(streams)
    every = statistics.median([g for _, g in unbroken_itls(streams)] or [0.0])
    out = []
    for s in streams:
        base = per_node.get(s.final_node) or every
        out += [gap / base for gap in seams(s) if base]
    return out


def hiccup_ratios(streams: list[StreamResult]) -> list[float]:
    """Each unbroken stream's largest gap over its node's inter-token gap (no faults: the baseline)."""
    per_node = node_itl(streams)
    return [max(s.gaps) / per_node[s.node] for s in streams
            if s.migrations == 0 and not s.broken and s.gaps and per_node.get(s.node)]


def mismatches(streams: list[StreamResult], ref: dict[int, StreamResult]) -> tuple[int, int]:
    """(token, text) mismatches of the finished streams against the reference."""
    done = [s for s in streams if not s.broken]
    tokens = sum(1 for s in done if s.ids != ref[s.prompt].ids)
    text = sum(1 for s in done if "".join(s.text) != "".join(ref[s.prompt].text))
    return tokens, text


def _p(xs: list[float], q: float) -> float:
    return percentile(xs, q) if xs else 0.0


def figures(calm: Phase, crashes: Phase, ref: dict[int, StreamResult], kill_every_s: float) -> list[Figure]:
    calm_itl = [g for _, g in unbroken_itls(calm.streams)]
    resume = [g for s in crashes.streams for g in seams(s)]
    tok_c, text_c = mismatches(crashes.streams, ref)
    tok_b, text_b = mismatches(calm.streams, ref)
    migrated = [s for s in crashes.streams if s.migrations]
    ms = 1000.0
    return [
        Figure(BENCH, "broken_streams", sum(s.broken for s in crashes.streams), sum(s.broken for s in calm.streams),
               "broken without faults", "ours = 0 (every stream a SIGKILL breaks ends normally elsewhere)",
               "streams"),
        Figure(BENCH, "token_mismatches", tok_c, tok_b, "mismatches without faults",
               "ours = 0 (a migrated stream's token ids equal the unbroken reference's)", "streams"),
        Figure(BENCH, "text_mismatches", text_c, text_b, "mismatches without faults",
               "ours = 0 (the text the client reads equals the unbroken reference's)", "streams"),
        Figure(BENCH, "resume_p50_ms", _p(resume, 0.5) * ms, _p(calm_itl, 0.5) * ms,
               "a stream's inter-token gap without faults, p50",
               "reported: the client's gap at a seam, in inter-token gaps (ratio)", "ms"),
        Figure(BENCH, "resume_p99_ms", _p(resume, 0.99) * ms, _p(calm_itl, 0.99) * ms,
               "a stream's inter-token gap without faults, p99",
               "reported: the client's gap at a seam, in inter-token gaps (ratio)", "ms"),
        Figure(BENCH, "resume_p99_vs_itl", _p(seam_ratios(crashes.streams), 0.99),
               _p(hiccup_ratios(calm.streams), 0.99),
               "an unbroken stream's largest gap / its node's median gap, p99, without faults",
               "reported: a seam's gap / the median inter-token gap of unmigrated streams on the node "
               "that finished it, p99", "x"),
        Figure(BENCH, "throughput_under_crashes", crashes.tokens_per_s, calm.tokens_per_s, "no crashes, same load",
               f"reported: tokens/s received with a node SIGKILLed every {kill_every_s:g}s "
               f"({len(crashes.kills)} kills)", "tokens/s"),
        Figure(BENCH, "migrated_streams", len(migrated), len(crashes.streams), "streams in the crash phase",
               "ours > 0 (the kills did break streams, which moved)", "streams"),
    ]


# -- the run ----------------------------------------------------------------------------------


async def _reference(url: str, key: str, max_tokens: int) -> dict[int, StreamResult]:
    """Each prompt streamed alone on the idle fabric: the ids every other run must match."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
        ref = {p: await stream_once(http, url, key, p, max_tokens) for p in range(len(TOPICS))}
    bad = [p for p, s in ref.items() if s.broken or len(s.ids) != max_tokens]
    if bad:
        raise RuntimeError(f"reference streams failed for prompts {bad}: {ref[bad[0]]}")
    return ref


def _router_metrics(url: str, token: str) -> str:
    """The router's migration lines, for the log (its own view of the seams)."""
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=5.0)
        return "\n".join(line for line in r.text.splitlines()
                         if line.startswith(("meridian_router_migration", "meridian_router_migrations"))
                         and "_bucket" not in line and "_created" not in line)
    return ""


def _seam_log(crashes: Phase, router: str) -> str:
    resume = [g for s in crashes.streams for g in seams(s)]
    killed = [g for s in crashes.streams for g in since_kill(s, crashes.kills)]
    count = re.search(r"^meridian_router_migration_resume_seconds_count (\S+)", router, re.M)
    total = re.search(r"^meridian_router_migration_resume_seconds_sum (\S+)", router, re.M)
    own = float(total.group(1)) / float(count.group(1)) if count and total and float(count.group(1)) else 0.0
    return (f"seams: {len(resume)}; the client's gap p50 {_p(resume, 0.5) * 1000:.0f} ms; from the SIGKILL to "
            f"the next token p50 {_p(killed, 0.5) * 1000:.0f} ms; the router's own resume (break seen -> first "
            f"continued event) mean {own * 1000:.0f} ms")


def _summary(name: str, phase: Phase) -> str:
    broken = [s for s in phase.streams if s.broken]
    why = Counter((s.error or (f"status {s.status}" if s.status != 200 else "no [DONE]"))[:80] for s in broken)
    return (f"{name}: {len(phase.streams)} streams in {phase.seconds:.1f}s, {phase.tokens_per_s:.0f} tokens/s, "
            f"{sum(s.migrations for s in phase.streams)} migrations, {len(broken)} broken {dict(why)}")


def run(concurrency: int = 8, seconds: float = 12.0, kill_every_s: float = 3.0, restart_after_s: float = 1.0,
        max_tokens: int = 200, router_env: dict[str, str] | None = None, rounds: int = 1) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = FabricSpec(work_dir=Path(tmp), regions=REGIONS, nodes_per_region=2,
                          default_client_location=REGIONS[0], router_env=dict(router_env or {}),
                          journal_dir=Path(tmp) / "journal")
        with local_fabric(spec, on_step=log) as fabric:
            info = fabric.info
            assert info is not None
            url, key = info.router_url, info.keys["global"]

            async def calm_phase(name: str) -> Phase:
                phase = await run_load(url, key, concurrency=concurrency, seconds=seconds / 2,
                                       max_tokens=max_tokens, in_flight={})
                log(_summary(name, phase))
                return phase

            async def main() -> tuple[dict[int, StreamResult], Phase, Phase]:
                ref = await _reference(url, key, max_tokens)
                # No faults for half a phase before each crash phase and after the last (the
                # fabric whole again): a shared machine's drift weighs on both sides alike.
                calm, crashes = [await calm_phase("no faults")], []
                for r in range(rounds):
                    crashes.append(await crash_phase(fabric, url, key, concurrency=concurrency, seconds=seconds,
                                                     max_tokens=max_tokens, kill_every_s=kill_every_s,
                                                     restart_after_s=restart_after_s))
                    log(_summary(f"crashes, round {r + 1}", crashes[-1]))
                    calm.append(await calm_phase("no faults"))
                return ref, merged(calm), merged(crashes)

            ref, calm, crashes = asyncio.run(main())
            read_seams(Path(tmp) / "journal" / "router.jsonl", crashes.streams)
            router = _router_metrics(url, info.cluster_token)
            log("router: " + router.replace("\n", "; "))
            log(_seam_log(crashes, router))
    return figures(calm, crashes, ref, kill_every_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8, help="streams in flight")
    ap.add_argument("--seconds", type=float, default=12.0, help="length of each phase")
    ap.add_argument("--kill-every", type=float, default=3.0, help="seconds between SIGKILLs")
    ap.add_argument("--restart-after", type=float, default=1.0, help="seconds a killed node stays down")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=1,
                    help="crash phases, each between no-fault phases of half its length")
    ap.add_argument("--router-env", action="append", default=[], metavar="MERIDIAN_X=V",
                    help="a router setting for this run (repeatable), e.g. its migration budget")
    args = ap.parse_args()
    router_env = dict(kv.split("=", 1) for kv in args.router_env if "=" in kv)
    if len(router_env) != len(args.router_env) or not all(k.startswith("MERIDIAN_") for k in router_env):
        ap.error("--router-env takes MERIDIAN_NAME=value")
    for fig in run(concurrency=args.concurrency, seconds=args.seconds, kill_every_s=args.kill_every,
                   restart_after_s=args.restart_after, max_tokens=args.max_tokens, router_env=router_env,
                   rounds=args.rounds):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
