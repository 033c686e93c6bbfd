"""The torch engine's half of prefill/decode disaggregation, without HTTP: a `hold_kv`
request's prompt KV outlives it under a lease on the engine's clock, is exported once,
and an `external_kv` request generated from it is token for token the co-located one,
whatever the decode engine's block size and whatever it already had in its prefix cache.
The payload format refuses what is not a payload and KV that is not for this prompt."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from node_testkit import make_settings, tokens_of

from data_plane.engine.base import EngineRequestError, GenerationRequest, SamplingParams
from data_plane.engine.kv_transfer import payload as kvp
from data_plane.engine.torch_engine import TorchEngine
from meridian.clock import ManualClock

PROMPT = list(range(3, 45))  # 42 tokens: two full blocks of 16 and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1)
LEASE_S = 10.0


@pytest.fixture
async def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def prefill(tiny_checkpoint: Path, clock: ManualClock) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(make_settings(tiny_checkpoint, kv_lease_s=LEASE_S), clock=clock)
    await eng.start()
    yield eng
    await eng.stop()


async def generate(engine: TorchEngine, rid: str, params: SamplingParams, **extra: object) -> list:
    return [o async for o in engine.generate(GenerationRequest(rid, PROMPT, params, **extra))]  # type: ignore[arg-type]


async def held(prefill: TorchEngine, rid: str = "p") -> str:
    outputs = await generate(prefill, rid, PREFILL, hold_kv=True)
    hold = outputs[-1].kv_hold
    assert hold is not None and hold.num_tokens == len(PROMPT) and len(hold.block_ids) == 3
    return hold.handle


async def test_held_kv_is_freed_when_its_lease_ends(prefill: TorchEngine, clock: ManualClock) -> None:
    handle = await held(prefill)
    assert prefill.stats().kv_cache_usage > 0
    await clock.settled()
    await clock.advance_async(LEASE_S - 0.5)
    assert prefill.stats().kv_cache_usage > 0
    await clock.advance_async(0.5)
    # The expiry goes through the worker thread; the next command after it sees it done.
    assert await prefill.take_kv(handle) is None
    assert prefill.stats().kv_cache_usage == 0
    assert not await prefill.release_kv(handle)


@pytest.mark.parametrize("block_size", [16, 8])
async def test_decode_from_exported_kv_is_the_colocated_generation(
        prefill: TorchEngine, tiny_checkpoint: Path, block_size: int) -> None:
    colocated = tokens_of(await generate(prefill, "c", GREEDY))
    handle = await held(prefill)
    payload = await prefill.take_kv(handle)
    assert payload is not None and payload.num_tokens == len(PROMPT)
    assert await prefill.take_kv(handle) is None  # one read per handle
    payload = kvp.decode(kvp.encode(payload))

    decode = TorchEngine(make_settings(tiny_checkpoint, block_size=block_size))
    await decode.start()
    try:
        assert kvp.mismatch(payload, decode.kv_layout(), PROMPT, None) is None
        outputs = await generate(decode, "d", GREEDY, external_kv=payload)
        assert tokens_of(outputs) == colocated
        assert outputs[0].cached_tokens == len(PROMPT)
        stats = decode.stats()
        assert stats.prompt_tokens_external_kv_transfer_total == len(PROMPT)
        assert stats.prompt_tokens_local_compute_total == 0
        # The transferred blocks are in the decode engine's prefix cache now.
        again = await generate(decode, "d2", GREEDY)
        assert tokens_of(again) == colocated and again[0].cached_tokens > 0
    finally:
        await decode.stop()


async def test_a_local_prefix_hit_is_kept_and_the_rest_imported(prefill: TorchEngine) -> None:
    colocated = tokens_of(await generate(prefill, "c", GREEDY))  # now cached here: 2 full blocks
    payload = await prefill.take_kv(await held(prefill, "p"))
    assert payload is not None
    outputs = await generate(prefill, "d", GREEDY, external_kv=payload)
    assert tokens_of(outputs) == colocated
    stats = prefill.stats()
    assert stats.prompt_tokens_local_cache_hit_total >= 32
    assert stats.prompt_tokens_external_kv_transfer_total == len(PROMPT) - 32
    assert outputs[0].cached_tokens == len(PROMPT)


async def test_garbage_kv_changes_the_output_so_the_import_is_really_attended(
        prefill: TorchEngine) -> None:
    colocated = tokens_of(await generate(prefill, "c", GREEDY, cache_salt="a"))
    payload = await prefill.take_kv(await held(prefill))
    assert payload is not None
    noise = dataclasses.replace(payload, keys=payload.keys * 0 + 3.0, values=payload.values * 0 - 3.0)
    outputs = await generate(prefill, "d", GREEDY, external_kv=noise, cache_salt="b")
    assert tokens_of(outputs) != colocated


async def test_payload_checks(prefill: TorchEngine) -> None:
    payload = await prefill.take_kv(await held(prefill))
    assert payload is not None
    data = kvp.encode(payload)
    for bad in (b"", b"NOPE" + data[4:], data[:-1], data + b"\0"):
        with pytest.raises(kvp.KVPayloadError):
            kvp.decode(bad)
    layout = prefill.kv_layout()
    assert kvp.mismatch(payload, layout, PROMPT, None) is None
    assert kvp.mismatch(payload, layout, PROMPT + [7], None) is None  # KV of a prefix
    assert "other tokens" in (kvp.mismatch(payload, layout, [1, *PROMPT[1:]], None) or "")
    assert "tokens of KV" in (kvp.mismatch(payload, layout, PROMPT[:-1], None) or "")
    assert "LoRA" in (kvp.mismatch(payload, layout, PROMPT, "sql") or "")
    other = dataclasses.replace(layout, model="other")
    assert "model" in (kvp.mismatch(payload, other, PROMPT, None) or "")
    # Nothing held any more after the export.
    assert prefill.stats().kv_cache_usage == 0


async def test_another_engines_kv_is_refused_as_a_request_error_not_run(prefill: TorchEngine) -> None:
    """The engine protocol names another node's KV only by the prompt it is for (ExternalKV);
    the torch engine takes its own form of it and says so of any other."""

    @dataclasses.dataclass(frozen=True)
    class OtherEnginesKV:
        num_tokens: int
        tokens_sha256: str

    foreign = OtherEnginesKV(len(PROMPT), "0" * 64)
    with pytest.raises(EngineRequestError, match="KVPayload"):
        await generate(prefill, "foreign", GREEDY, external_kv=foreign)
    assert prefill.stats().running == 0
