"""The batched, paged engine produces exactly what a plain full-recompute forward does.

Greedy decoding of 20 random prompts must be token-identical to a reference that
re-runs the whole sequence through the model for every token (no cache at all), at
batch 1 and batch 32, with chunked prefill on and off, cold and with prefix-cache
hits, and when the KV cache is so small that sequences get preempted.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from node_testkit import make_settings

from data_plane.engine.base import GenerationRequest, SamplingParams
from data_plane.engine.torch_engine import TorchEngine
from data_plane.model.loader import load_model

MAX_TOKENS = 10
BLOCK_SIZE = 4


def make_prompts(n: int = 20, seed: int = 7) -> list[list[int]]:
    """Random prompts in four families sharing a 3-block prefix, so a warm run hits the cache."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 1000) for _ in range(3 * BLOCK_SIZE)] for _ in range(4)]
    prompts = []
    for i in range(n):
        suffix = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 60))]
        prompts.append(prefixes[i % 4] + suffix)
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> list[list[int]]:
    model = load_model(tiny_checkpoint, dtype="float32", device="cpu")
    outs = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            logits = model.forward_full(torch.tensor(ids))
            ids.append(int(torch.argmax(logits[-1])))
        outs.append(ids[len(prompt):])
    return outs


async def generate_all(engine: TorchEngine, prompts: Sequence[list[int]], tag: str) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        req = GenerationRequest(f"{tag}-{i}", prompt, params)
        return [t async for o in engine.generate(req) for t in o.token_ids]

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "prefix-hits"])
async def test_greedy_matches_full_recompute_reference(
    tiny_checkpoint: Path, reference: list[list[int]], batch: int, chunked: bool, warm: bool
) -> None:
    engine = TorchEngine(make_settings(
        tiny_checkpoint, max_num_seqs=batch, block_size=BLOCK_SIZE,
        enable_chunked_prefill=chunked, max_num_batched_tokens=24 if chunked else 64,
        enable_prefix_caching=warm,
    ))
    await engine.start()
    try:
        if warm:
            # Warm the cache with the shared prefixes only, then run the real prompts.
            await generate_all(engine, [p[: 3 * BLOCK_SIZE + 1] for p in PROMPTS[:4]], "warm")
            hits_before = engine.stats().prefix_cache_hits_total
        got = await generate_all(engine, PROMPTS, "run")
        stats = engine.stats()
    finally:
        await engine.stop()
    assert got == reference
    if warm:
        # Every prompt's 3 shared blocks were served from the cache.
        assert stats.prefix_cache_hits_total - hits_before >= 20 * 3 * BLOCK_SIZE
    else:
        assert stats.prefix_cache_hits_total == 0
    assert stats.running == 0 and stats.waiting == 0


async def test_preemption_under_kv_pressure_loses_nothing(
    tiny_checkpoint: Path, reference: list[list[int]]
) -> None:
    # 24 blocks of 4 tokens = 96 slots: a handful of sequences at a time, 20 arriving at once.
    per_block = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    engine = TorchEngine(make_settings(
        tiny_checkpoint, max_num_seqs=32, block_size=BLOCK_SIZE, max_num_batched_tokens=32,
        kv_cache_memory_bytes=max(64 * 1024, 24 * per_block),
    ))
    await engine.start()
    try:
        got = await generate_all(engine, PROMPTS, "p")
        stats = engine.stats()
    finally:
        await engine.stop()
    assert got == reference
    assert stats.num_preemptions_total > 0
    assert stats.requests_finished_total == 20 and stats.running == 0
    # Recomputing a preempted request does not count its tokens as prompt tokens again.
    assert stats.prompt_tokens_total == sum(len(p) for p in PROMPTS)
