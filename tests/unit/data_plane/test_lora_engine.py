"""LoRA in the torch engine: adapters chosen per request, batched with base requests,
loaded on demand into a bounded set of resident adapters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from node_testkit import make_settings

from data_plane.engine.base import EngineRequestError, GenerationRequest, SamplingParams
from data_plane.engine.torch_engine import TorchEngine
from data_plane.lora import load_adapter
from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.loader import load_model

PROMPTS = [[5, 17, 300, 42, 9], [0, 250, 12, 77, 500, 31, 8], [7, 7, 7, 900, 2, 64, 33, 120, 4]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_lora(tiny_checkpoint, root / "alpha", seed=1)
    make_tiny_lora(tiny_checkpoint, root / "beta", seed=2)
    return root


def merged_greedy(checkpoint: Path, adapter_dir: Path | None, prompt: list[int]) -> list[int]:
    """Reference: the adapter merged into the weights, full recompute per token."""
    model = load_model(checkpoint, dtype="float32", device="cpu")
    if adapter_dir is not None:
        adapter = load_adapter(adapter_dir, model.config, max_rank=64)
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                for module, linear in [
                    *((m, getattr(layer.self_attn, m)) for m in ("q_proj", "k_proj", "v_proj", "o_proj")),
                    *((m, getattr(layer.mlp, m)) for m in ("gate_proj", "up_proj", "down_proj")),
                ]:
                    w = adapter.get(i, module)
                    if w is not None:
                        linear.weight += w.scaling * (w.b @ w.a)
    ids = list(prompt)
    for _ in range(MAX_TOKENS):
        ids.append(int(torch.argmax(model.forward_full(torch.tensor(ids))[-1])))
    return ids[len(prompt):]


async def run(engine: TorchEngine, rid: str, prompt: list[int], lora: str | None) -> list[int]:
    req = GenerationRequest(rid, prompt, GREEDY, lora_name=lora)
    return [t async for o in engine.generate(req) for t in o.token_ids]


async def test_mixed_batch_of_base_and_adapter_requests_matches_merged_weights(
    tiny_checkpoint: Path, adapters: Path
) -> None:
    engine = TorchEngine(make_settings(tiny_checkpoint, lora_dir=adapters, max_loras=2, block_size=4))
    await engine.start()
    try:
        assert engine.lora_adapters() == ["alpha", "beta"]
        jobs = [(p, lora) for p in PROMPTS for lora in (None, "alpha", "beta")]
        got = await asyncio.gather(*(run(engine, f"r{i}", p, lora) for i, (p, lora) in enumerate(jobs)))
        stats = engine.stats()
    finally:
        await engine.stop()
    for (prompt, lora), tokens in zip(jobs, got, strict=True):
        expected = merged_greedy(tiny_checkpoint, adapters / lora if lora else None, prompt)
        assert tokens == expected, (prompt, lora)
    assert set(stats.loaded_loras) == {"alpha", "beta"} and stats.max_loras == 2


async def test_more_adapters_than_slots_wait_their_turn(tiny_checkpoint: Path, adapters: Path) -> None:
    engine = TorchEngine(make_settings(tiny_checkpoint, lora_dir=adapters, max_loras=1))
    await engine.start()
    try:
        jobs = [("alpha" if i % 2 else "beta") for i in range(6)]
        got = await asyncio.gather(*(run(engine, f"r{i}", PROMPTS[0], lora) for i, lora in enumerate(jobs)))
        stats = engine.stats()
    finally:
        await engine.stop()
    by_adapter = {lora: tokens for lora, tokens in zip(jobs, got, strict=True)}
    assert by_adapter["alpha"] != by_adapter["beta"]
    assert all(tokens == by_adapter[lora] for lora, tokens in zip(jobs, got, strict=True))
    assert len(stats.loaded_loras) == 1 and stats.requests_finished_total == 6


async def test_adapter_prefix_cache_is_not_shared_with_the_base_model(
    tiny_checkpoint: Path, adapters: Path
) -> None:
    engine = TorchEngine(make_settings(tiny_checkpoint, lora_dir=adapters, block_size=4))
    await engine.start()
    try:
        prompt = list(range(1, 30))
        await run(engine, "base", prompt, None)
        hits = engine.stats().prefix_cache_hits_total
        await run(engine, "alpha", prompt, "alpha")
        assert engine.stats().prefix_cache_hits_total == hits
        await run(engine, "alpha-again", prompt, "alpha")
        assert engine.stats().prefix_cache_hits_total > hits
        with pytest.raises(EngineRequestError, match="unknown LoRA adapter"):
            await run(engine, "nope", prompt, "gamma")
    finally:
        await engine.stop()
