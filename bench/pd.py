"""Prefill/decode disaggregation against co-located serving, same nodes (issue 24).

    python -m bench.pd [--seconds S] [--decoders C] [--long-rate R] [--long-words W]
                       [--max-tokens N] [--engine torch|vllm] [--device cpu|cuda]

Two local fabrics, one after the other, each with two nodes in aws:us-east-1 serving the
tiny demo model: co-located (two ordinary replicas; the baseline) and disaggregated (one
prefill worker and one decode worker). On each, for `seconds`:

- `decoders` clients keep greedy chat streams with short prompts in flight (closed loop,
  `max_tokens` tokens each, ignore_eos): the decode traffic whose steadiness P/D is for;
- long prompts (`long_words` words, a few tokens each) keep arriving, open loop, at
  `long_rate` per second, streamed so that their time to first token is seen.

Figures (ours: disaggregated; baseline: co-located, same machine, same load):
- `itl_p95_pd_vs_colocated`: the decode streams' inter-token gaps, p95 (ms). Co-located,
  a long prompt's prefill chunks share engine steps with the decodes and stretch them;
  disaggregated, the decode worker only pulls the prompt's KV.
- `itl_p50`: the same at the median.
- `ttft_p50_long` / `ttft_p95_long`: the long prompts' time to first token (ms): one more
  hop and a KV pull, against a prefill that shares its node with decodes.
- `ttft_p50_short`: the decode streams' time to first token (ms).
- `throughput`: generated tokens per second, all requests.
- `long_prompts_disaggregated`: requests the router served disaggregated in the P/D run (its
  `meridian_router_pd_requests`), over the long prompts sent; goal 1 (the figures above
  measure P/D). The decode streams' short prompts are below the router's
  `PD_MIN_PROMPT_TOKENS` (256) and served whole by the decode worker, as they should be.

On a CPU machine both nodes share its cores (the local fabric gives each node its share of
threads), so the figures are ratios of one run, not absolute latencies; `--device cuda`
on a GPU machine gives each node the GPU (record the GPU's name with the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import Figure, percentile
from bench.migration import StreamResult, stream_chat
from chaos.observe import metric_samples
from localfabric import DEMO_MODEL, FabricSpec, local_fabric
from meridian.contracts import NodeRole

BENCH = "pd"
REGION = "aws:us-east-1"
_WORDS = ("river", "lamp", "stone", "cloud", "orange", "window", "signal", "garden", "copper", "winter",
          "engine", "harbor", "violet", "ladder", "thunder", "meadow", "pocket", "silver", "canyon", "ember")


def log(msg: str) -> None:
    print(f"[bench.pd] {msg}", file=sys.stderr, flush=True)


@dataclass
class Run:
    """What the clients of one topology saw."""

    short: list[StreamResult] = field(default_factory=list)
    long: list[StreamResult] = field(default_factory=list)
    seconds: float = 0.0
    disaggregated: float = 0.0
    served: float = 0.0

    def gaps_ms(self) -> list[float]:
        return [g * 1000 for s in self.short if not s.broken for g in s.gaps]

    def ttft_ms(self, streams: list[StreamResult]) -> list[float]:
        return [(s.times[0] - s.sent) * 1000 for s in streams if s.times and not s.broken]

    def tokens_per_s(self) -> float:
        return sum(len(s.ids) for s in self.short + self.long) / self.seconds if self.seconds else 0.0

    def broken(self) -> int:
        return sum(s.broken for s in self.short + self.long)


def _body(content: str, max_tokens: int) -> dict:
    return {"model": DEMO_MODEL, "stream": True, "return_token_ids": True, "temperature": 0, "ignore_eos": True,
            "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}


async def _load(url: str, key: str, *, seconds: float, decoders: int, long_rate: float, long_words: int,
                max_tokens: int, seed: int) -> Run:
    rng = random.Random(seed)
    run = Run()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
        start = time.perf_counter()

        async def decoder(i: int) -> None:
            n = 0
            while time.perf_counter() - start < seconds:
                n += 1
                body = _body(f"Count the {_WORDS[(i + n) % len(_WORDS)]}s, client {i} turn {n}.", max_tokens)
                run.short.append(await stream_chat(http, url, key, body))

        async def long_prompts() -> None:
            pending: list[asyncio.Task[StreamResult]] = []
            next_at = start
            while (now := time.perf_counter()) - start < seconds:
                if now >= next_at:
                    # Unique text from the first word: no prefix-cache hit makes a prefill cheap.
                    text = " ".join(rng.choice(_WORDS) for _ in range(long_words))
                    pending.append(asyncio.create_task(stream_chat(http, url, key, _body(f"{len(pending)} {text}", 4))))
                    next_at += rng.expovariate(long_rate)
                await asyncio.sleep(max(0.0, min(next_at - time.perf_counter(), 0.05)))
            run.long = list(await asyncio.gather(*pending))

        await asyncio.gather(long_prompts(), *(decoder(i) for i in range(decoders)))
        run.seconds = time.perf_counter() - start
    return run


def _router_pd(url: str, token: str) -> tuple[float, float]:
    """(requests served disaggregated, requests served) from the router's metrics."""
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=10).text
    disaggregated = sum(v for labels, v in metric_samples(text, "meridian_router_pd_requests")
                        if labels.get("how") == "disaggregated")
    return disaggregated, sum(v for _, v in metric_samples(text, "meridian_router_requests"))


def measure(roles: tuple[NodeRole, ...], *, engine: str, device: str, **load: float) -> Run:
    with tempfile.TemporaryDirectory() as tmp:
        spec = FabricSpec(work_dir=Path(tmp), regions=(REGION,), default_client_location=REGION, engine=engine,
                          region_roles={REGION: roles},
                          node_env={"MERIDIAN_NODE_DEVICE": device, "MERIDIAN_NODE_MAX_MODEL_LEN": "4096"})
        with local_fabric(spec, on_step=log) as fabric:
            info = fabric.info
            assert info is not None
            url, key = info.router_url, info.keys["global"]
            # Warm both nodes (first requests pay for lazy initialisation).
            asyncio.run(_load(url, key, seconds=2.0, decoders=2, long_rate=1.0, long_words=50, max_tokens=8, seed=99))
            run = asyncio.run(_load(url, key, **load))  # type: ignore[arg-type]
            run.disaggregated, run.served = _router_pd(url, info.cluster_token)
    log(f"{'/'.join(r.value for r in roles)}: {len(run.short)} decode streams, {len(run.long)} long prompts, "
        f"{run.broken()} broken, {run.tokens_per_s():.0f} tok/s, {run.disaggregated:.0f} of {run.served:.0f} "
        "requests disaggregated")
    return run


def _p(xs: list[float], q: float) -> float:
    return percentile(xs, q) if xs else float("nan")


def figures(pd: Run, colocated: Run) -> list[Figure]:
    def fig(metric: str, ours: float, base: float, goal: str, unit: str = "ms") -> Figure:
        return Figure(BENCH, metric, ours, base, "co-located, same nodes", goal, unit)

    return [
        fig("itl_p95_pd_vs_colocated", _p(pd.gaps_ms(), 0.95), _p(colocated.gaps_ms(), 0.95),
            "below 1: long prefills do not stretch decode steps"),
        fig("itl_p50", _p(pd.gaps_ms(), 0.5), _p(colocated.gaps_ms(), 0.5), "about 1"),
        fig("ttft_p50_long", _p(pd.ttft_ms(pd.long), 0.5), _p(colocated.ttft_ms(colocated.long), 0.5),
            "reported: a hop and a KV pull against a prefill sharing its node"),
        fig("ttft_p95_long", _p(pd.ttft_ms(pd.long), 0.95), _p(colocated.ttft_ms(colocated.long), 0.95), "reported"),
        fig("ttft_p50_short", _p(pd.ttft_ms(pd.short), 0.5), _p(colocated.ttft_ms(colocated.short), 0.5), "reported"),
        fig("throughput", pd.tokens_per_s(), colocated.tokens_per_s(), "reported (higher is better)", "tokens/s"),
        Figure(BENCH, "long_prompts_disaggregated", pd.disaggregated / len(pd.long) if pd.long else 0.0, 1.0,
               "every long prompt", "1 (the P/D figures measure P/D)", "share"),
    ]


def run(seconds: float = 20.0, decoders: int = 4, long_rate: float = 1.0, long_words: int = 600,
        max_tokens: int = 64, engine: str = "torch", device: str = "cpu", seed: int = 0) -> list[Figure]:
    load = dict(seconds=seconds, decoders=decoders, long_rate=long_rate, long_words=long_words,
                max_tokens=max_tokens, seed=seed)
    colocated = measure((NodeRole.BOTH, NodeRole.BOTH), engine=engine, device=device, **load)
    pd = measure((NodeRole.PREFILL, NodeRole.DECODE), engine=engine, device=device, **load)
    return figures(pd, colocated)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="load per topology")
    ap.add_argument("--decoders", type=int, default=4, help="decode streams in flight")
    ap.add_argument("--long-rate", type=float, default=1.0, help="long prompts per second")
    ap.add_argument("--long-words", type=int, default=600, help="words per long prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per decode stream")
    ap.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    ap.add_argument("--device", default="cpu", help="the nodes' torch device (cuda on a GPU machine)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    for f in run(a.seconds, a.decoders, a.long_rate, a.long_words, a.max_tokens, a.engine, a.device, a.seed):
        print(f.json_line(), flush=True)


if __name__ == "__main__":
    main()
