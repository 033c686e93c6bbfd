"""Engine: the node's engine against Hugging Face transformers and against itself with one
feature turned off, side by side in one run, on a generated checkpoint.

    python -m bench.engine [--full] [--device cpu|cuda] [--dtype auto|float32|bfloat16]
                           [--engine torch] [--model-dir DIR] [--threads N]

Figures (ours / baseline, each measured in this run):

- throughput_vs_hf_sequential: generated tokens/s of 32 concurrent mixed-length requests
  on our engine / transformers' `generate` run on the same requests one at a time
  (greedy, same checkpoint, prompts and max_new_tokens; EOS ignored on both sides).
- throughput_vs_batch1: the same 32 requests / the same engine with max_num_seqs=1.
- p95_itl_chunked_vs_unchunked: P95 gap between successive outputs of running decodes
  while ~2k-token prompts keep arriving, with chunked prefill / without it.
- ttft_cached_prefix_vs_cold: median time to first token of prompts whose first 90% is
  in the prefix cache / of prompts of the same length that share nothing.

The engine is reached only through the Engine protocol (`create_engine` on NodeSettings),
so any registered engine can be measured. The default model is a generated Llama with
hidden 256, 4 layers and 4096 positions: big enough that a step's cost depends on how
many tokens it batches, small enough for two CPU cores. `--model-dir` measures a real
checkpoint instead; NodeSettings still reads MERIDIAN_NODE_* from the environment for
whatever this bench leaves unset (the KV cache size for a big model, say).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import Figure, median, percentile
from data_plane.engine.base import Engine, GenerationRequest, SamplingParams, create_engine
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from meridian.settings.node import NodeSettings

BENCH = "engine"

BENCH_ARCH = TinyArch(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=688,
    max_position_embeddings=4096,
)
MAX_MODEL_LEN = 4096
NUM_REQUESTS = 32
# Prefix-cache hits are whole KV blocks: keep the shared prefix a multiple of any
# usual block size (16, 32, 64, 128) so that 90% of the prompt really can be a hit.
PREFIX_ALIGN = 128


@dataclass(frozen=True, slots=True)
class Workload:
    """Sizes of one run; `quick` is `make bench`'s, `full` is `--full`'s."""

    prompt_len: tuple[int, int]
    new_tokens: tuple[int, int]
    throughput_repeats: int
    itl_decodes: int
    itl_long_prompt_len: int
    itl_long_prompts: int
    # Long prompts submitted at once; the next arrives as soon as one is prefilled. One
    # keeps the unchunked baseline at one 2k prefill per step rather than several.
    itl_long_in_flight: int
    itl_chunk_tokens: int
    ttft_prompt_len: int
    ttft_repeats: int


QUICK = Workload(
    prompt_len=(16, 256), new_tokens=(32, 128), throughput_repeats=1,
    itl_decodes=4, itl_long_prompt_len=2000, itl_long_prompts=4, itl_long_in_flight=1,
    itl_chunk_tokens=256, ttft_prompt_len=1280, ttft_repeats=5,
)
FULL = Workload(
    prompt_len=(16, 1024), new_tokens=(64, 256), throughput_repeats=3,
    itl_decodes=8, itl_long_prompt_len=2000, itl_long_prompts=12, itl_long_in_flight=1,
    itl_chunk_tokens=256, ttft_prompt_len=2560, ttft_repeats=15,
)


class BenchError(RuntimeError):
    """The engine did not do what the measurement needs (wrong lengths, no outputs...)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What is measured: checkpoint, engine and where it runs."""

    model_dir: Path
    engine: str
    device: str
    dtype: str
    vocab_size: int


@dataclass
class Trace:
    """When each output of one request arrived (perf_counter, on the event loop)."""

    submitted: float
    stamps: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finished: bool = False

    @property
    def ttft(self) -> float:
        if not self.stamps:
            raise BenchError("request produced no token")
        return self.stamps[0] - self.submitted


def log(msg: str) -> None:
    """Progress and absolute numbers go to stderr; stdout carries only the JSON figures."""
    print(f"[bench.engine] {msg}", file=sys.stderr, flush=True)


# --- workload ------------------------------------------------------------------------


def random_ids(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def throughput_requests(work: Workload, vocab_size: int, seed: int) -> list[GenerationRequest]:
    """NUM_REQUESTS requests of mixed prompt and output lengths, deterministic for a seed."""
    rng = random.Random(seed)
    reqs = []
    for i in range(NUM_REQUESTS):
        prompt = random_ids(rng, vocab_size, rng.randint(*work.prompt_len))
        reqs.append(GenerationRequest(f"tp{seed}-{i}", prompt, greedy(rng.randint(*work.new_tokens))))
    return reqs


# --- engine side -----------------------------------------------------------------------


def node_settings(target: Target, **overrides: Any) -> NodeSettings:
    values: dict[str, Any] = {
        "model_dir": target.model_dir,
        "engine": target.engine,
        "control_plane_url": None,
        "device": target.device,
        "dtype": target.dtype,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": NUM_REQUESTS,
        "max_num_batched_tokens": 512,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "max_waiting_requests": 256,
    }
    values.update(overrides)
    return NodeSettings(**values)


@contextlib.asynccontextmanager
async def running_engine(settings: NodeSettings) -> AsyncIterator[Engine]:
    """A started engine, warmed up (first-call allocations, lazy kernels) and then stopped."""
    engine = create_engine(settings.engine, settings)
    await engine.start()
    try:
        rng = random.Random(-1)
        warm = [GenerationRequest(f"warmup-{i}", random_ids(rng, 256, 64), greedy(8)) for i in range(2)]
        await asyncio.gather(*(run_request(engine, r) for r in warm))
        yield engine
    finally:
        await engine.stop()


async def run_request(engine: Engine, req: GenerationRequest) -> Trace:
    trace = Trace(submitted=time.perf_counter())
    async with contextlib.aclosing(engine.generate(req)) as outputs:
        async for out in outputs:
            now = time.perf_counter()
            if not trace.stamps:
                trace.cached_tokens = out.cached_tokens
            if out.token_ids:
                trace.stamps.append(now)
                trace.tokens.extend(out.token_ids)
            trace.finished = out.finish_reason is not None
    return trace


async def engine_throughput(engine: Engine, reqs: list[GenerationRequest]) -> tuple[int, float, list[Trace]]:
    """(generated tokens, seconds, traces) of all `reqs` submitted at once."""
    t0 = time.perf_counter()
    traces = await asyncio.gather(*(run_request(engine, r) for r in reqs))
    elapsed = time.perf_counter() - t0
    for req, tr in zip(reqs, traces, strict=True):
        if len(tr.tokens) != req.sampling_params.max_tokens:
            raise BenchError(f"{req.request_id}: {len(tr.tokens)} tokens, asked for "
                             f"{req.sampling_params.max_tokens} with ignore_eos")
    return sum(len(tr.tokens) for tr in traces), elapsed, list(traces)


@dataclass
class _Window:
    start: float | None = None
    end: float | None = None


async def _decode_until(engine: Engine, req: GenerationRequest, window: _Window,
                        trace: Trace, started: asyncio.Event) -> None:
    """Decode until the first output after the window closed, so the gap that spans
    its end is measured too; then close the stream (which aborts the request).

    `started` is set once decoding is steady (two outputs), or when this ends early.
    """
    try:
        async with contextlib.aclosing(engine.generate(req)) as outputs:
            async for out in outputs:
                now = time.perf_counter()
                if out.token_ids:
                    trace.stamps.append(now)
                if len(trace.stamps) >= 2:
                    started.set()
                if out.finish_reason is not None:
                    trace.finished = True
                    return
                if window.end is not None and now > window.end:
                    return
    finally:
        started.set()


async def p95_itl_under_long_prompts(engine: Engine, work: Workload, vocab_size: int,
                                     seed: int) -> tuple[float, int]:
    """(P95 inter-token gap in seconds, gaps counted) of decodes while long prompts flow."""
    rng = random.Random(seed)
    max_decode = MAX_MODEL_LEN - 32
    decodes = [GenerationRequest(f"itl-decode-{i}", random_ids(rng, vocab_size, 32), greedy(max_decode))
               for i in range(work.itl_decodes)]
    longs = iter([GenerationRequest(f"itl-long-{i}", random_ids(rng, vocab_size, work.itl_long_prompt_len),
                                    greedy(1))
                  for i in range(work.itl_long_prompts)])
    window = _Window()
    traces = [Trace(submitted=time.perf_counter()) for _ in decodes]
    started = [asyncio.Event() for _ in decodes]
    tasks = [asyncio.create_task(_decode_until(engine, req, window, tr, ev))
             for req, tr, ev in zip(decodes, traces, started, strict=True)]
    try:
        # Measure from steady decoding on, not from the decodes' own prefills.
        await asyncio.gather(*(ev.wait() for ev in started))
        for task in tasks:
            if task.done():
                task.result()  # a decode that failed fails the bench now

        async def feed() -> None:
            for req in longs:
                await run_request(engine, req)

        window.start = time.perf_counter()
        await asyncio.gather(*(feed() for _ in range(work.itl_long_in_flight)))
        window.end = time.perf_counter()
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if any(tr.finished for tr in traces):
        raise BenchError("a decode reached max_tokens before the long prompts were done")
    assert window.start is not None and window.end is not None
    gaps = [b - a for tr in traces for a, b in zip(tr.stamps, tr.stamps[1:], strict=False)
            if b > window.start and a < window.end]
    if not gaps:
        raise BenchError("no decode output while the long prompts were served")
    return percentile(gaps, 0.95), len(gaps)


async def ttft_cached_vs_cold(engine: Engine, work: Workload, vocab_size: int,
                              seed: int) -> tuple[list[float], list[float], list[int]]:
    """TTFTs (seconds) of prompts with a cached 90% prefix and of cold prompts, same length."""
    rng = random.Random(seed)
    total = work.ttft_prompt_len
    prefix_len = (total * 9 // 10) // PREFIX_ALIGN * PREFIX_ALIGN
    prefix = random_ids(rng, vocab_size, prefix_len)
    await run_request(engine, GenerationRequest(
        "ttft-warm", prefix + random_ids(rng, vocab_size, total - prefix_len), greedy(1)))
    cached: list[float] = []
    cold: list[float] = []
    hits: list[int] = []
    for i in range(work.ttft_repeats):
        hot_req = GenerationRequest(f"ttft-cached-{i}", prefix + random_ids(rng, vocab_size, total - prefix_len),
                                    greedy(1))
        cold_req = GenerationRequest(f"ttft-cold-{i}", random_ids(rng, vocab_size, total), greedy(1))
        # Alternate the order so drift in the machine's load hits both alike.
        for req in (hot_req, cold_req) if i % 2 == 0 else (cold_req, hot_req):
            tr = await run_request(engine, req)
            if req is hot_req:
                cached.append(tr.ttft)
                hits.append(tr.cached_tokens)
            else:
                cold.append(tr.ttft)
    return cached, cold, hits


# --- transformers side -------------------------------------------------------------------


class HFSequential:
    """transformers' own model on the same checkpoint, serving requests one at a time."""

    def __init__(self, target: Target) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from data_plane.model.loader import resolve_dtype

        hf_logging.disable_progress_bar()
        raw_dtype = json.loads((target.model_dir / "config.json").read_text()).get("torch_dtype")
        self._device = target.device
        self._model = AutoModelForCausalLM.from_pretrained(
            target.model_dir, dtype=resolve_dtype(target.dtype, raw_dtype)
        ).to(target.device).eval()
        # Ignore EOS exactly as the engine's ignore_eos does: no stop and no masking, so
        # both sides make the same greedy choices and produce the same lengths.
        self._model.generation_config.eos_token_id = None
        self.generate([1, 2, 3, 4], 4)  # warm-up

    @torch.inference_mode()
    def generate(self, prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt], device=self._device)
        out = self._model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        return [int(t) for t in out[0, len(prompt):]]

    def throughput(self, reqs: list[GenerationRequest]) -> tuple[int, float, list[list[int]]]:
        """(generated tokens, seconds, token ids) of `reqs` served one after the other."""
        t0 = time.perf_counter()
        outputs = [self.generate(r.prompt_token_ids, r.sampling_params.max_tokens) for r in reqs]
        elapsed = time.perf_counter() - t0
        for req, out in zip(reqs, outputs, strict=True):
            if len(out) != req.sampling_params.max_tokens:
                raise BenchError(f"transformers generated {len(out)} tokens for {req.request_id}")
        return sum(len(o) for o in outputs), elapsed, outputs


# --- the run --------------------------------------------------------------------------------


@dataclass
class _Rate:
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds

    def __str__(self) -> str:
        return f"{self.tokens} tokens in {self.seconds:.2f} s = {self.per_s:.1f} tok/s"


async def _throughput_figures(target: Target, work: Workload, seed: int) -> list[Figure]:
    hf = await asyncio.to_thread(HFSequential, target)
    rates = {"hf": _Rate(), "ours": _Rate(), "batch1": _Rate()}
    same = total = 0
    async with running_engine(node_settings(target)) as ours, \
            running_engine(node_settings(target, max_num_seqs=1)) as batch1:
        # The three run back to back on each request set, so that the machine's load
        # (shared, noisy) changes little between a figure and its baselines.
        for k in range(work.throughput_repeats):
            reqs = throughput_requests(work, target.vocab_size, seed + k)
            n, s, hf_outputs = await asyncio.to_thread(hf.throughput, reqs)
            rates["hf"].add(n, s)
            n, s, traces = await engine_throughput(ours, reqs)
            rates["ours"].add(n, s)
            n, s, _ = await engine_throughput(batch1, reqs)
            rates["batch1"].add(n, s)
            same += sum(tr.tokens == out for tr, out in zip(traces, hf_outputs, strict=True))
            total += len(reqs)
        preempted = ours.stats().num_preemptions_total
    log(f"transformers sequential: {rates['hf']}")
    log(f"engine max_num_seqs={NUM_REQUESTS}: {rates['ours']} ({preempted} preemptions)")
    log(f"engine max_num_seqs=1: {rates['batch1']}")
    # Not a figure, a sanity check: greedy decoding of the same weights should agree.
    log(f"greedy outputs identical to transformers' for {same}/{total} requests")
    ours_rate = rates["ours"].per_s
    return [
        Figure(BENCH, "throughput_vs_hf_sequential", ours_rate, rates["hf"].per_s,
               "transformers generate(), one request at a time", ">= 5", "tokens/s"),
        Figure(BENCH, "throughput_vs_batch1", ours_rate, rates["batch1"].per_s,
               "same engine, max_num_seqs=1", ">= 5", "tokens/s"),
    ]


async def _itl_figure(target: Target, work: Workload, seed: int) -> Figure:
    p95: dict[str, float] = {}
    for name, overrides in (
        ("chunked", {"enable_chunked_prefill": True, "max_num_batched_tokens": work.itl_chunk_tokens}),
        # Without chunking a step must hold a whole prompt: vLLM's budget rule.
        ("unchunked", {"enable_chunked_prefill": False, "max_num_batched_tokens": MAX_MODEL_LEN}),
    ):
        settings = node_settings(target, enable_prefix_caching=False, **overrides)
        async with running_engine(settings) as engine:
            p95[name], n = await p95_itl_under_long_prompts(engine, work, target.vocab_size, seed)
        log(f"ITL {name}: p95 {p95[name] * 1000:.1f} ms over {n} gaps, "
            f"{work.itl_decodes} decodes, {work.itl_long_prompts} prompts of {work.itl_long_prompt_len} tokens")
    return Figure(BENCH, "p95_itl_chunked_vs_unchunked", p95["chunked"] * 1000, p95["unchunked"] * 1000,
                  "same engine, enable_chunked_prefill=False", "<= 0.5", "ms")


async def _ttft_figure(target: Target, work: Workload, seed: int) -> Figure:
    async with running_engine(node_settings(target, enable_prefix_caching=True)) as engine:
        cached, cold, hits = await ttft_cached_vs_cold(engine, work, target.vocab_size, seed)
    log(f"TTFT of {work.ttft_prompt_len}-token prompts: cached prefix median {median(cached) * 1000:.1f} ms "
        f"(cached_tokens {sorted(set(hits))}), cold median {median(cold) * 1000:.1f} ms")
    return Figure(BENCH, "ttft_cached_prefix_vs_cold", median(cached) * 1000, median(cold) * 1000,
                  "same engine, same-length prompt sharing no prefix", "<= 0.3", "ms")


async def _measure(target: Target, work: Workload, seed: int) -> list[Figure]:
    return [
        *await _throughput_figures(target, work, seed),
        await _itl_figure(target, work, seed),
        await _ttft_figure(target, work, seed),
    ]


def resolve_device(requested: str) -> str:
    """`requested`, or "cpu" (said on stderr) when CUDA is asked for but absent."""
    if requested.startswith("cuda") and not torch.cuda.is_available():
        log(f"--device {requested}: CUDA is not available to torch {torch.__version__}; "
            "falling back to cpu")
        return "cpu"
    return requested


@contextlib.contextmanager
def checkpoint(model_dir: Path | None, seed: int) -> Iterator[Path]:
    if model_dir is not None:
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="meridian-bench-") as tmp:
        yield make_tiny_checkpoint(Path(tmp) / "bench-llama", seed=seed, arch=BENCH_ARCH)


def run(*, full: bool = False, device: str = "cpu", dtype: str = "auto", engine: str = "torch",
        model_dir: Path | None = None, seed: int = 0, work: Workload | None = None) -> list[Figure]:
    """Measure every figure of this bench; quick form unless `full` (or `work`'s sizes)."""
    work = work or (FULL if full else QUICK)
    device = resolve_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    with checkpoint(model_dir, seed) as ckpt:
        config = json.loads((ckpt / "config.json").read_text())
        target = Target(ckpt, engine, device, dtype, int(config["vocab_size"]))
        log(f"model {ckpt.name} (hidden {config['hidden_size']}, {config['num_hidden_layers']} layers), "
            f"engine {engine}, device {device}, dtype {dtype}, torch threads {torch.get_num_threads()}, "
            f"{'full' if full else 'quick'} workload")
        return asyncio.run(_measure(target, work, seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="longer outputs and prompts, more repetitions")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (falls back to cpu without CUDA)")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--engine", default="torch", help="registered engine name")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a Hugging Face checkpoint to measure instead of the generated one")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for fig in run(full=args.full, device=args.device, dtype=args.dtype, engine=args.engine,
                   model_dir=args.model_dir, seed=args.seed):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
