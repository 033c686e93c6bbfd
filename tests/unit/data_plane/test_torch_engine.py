"""The torch engine: deterministic generation, stop conditions, queueing and aborts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from node_testkit import ENGINE_PROMPT, eventually, make_settings, run_request, tokens_of

from data_plane.engine.base import (
    ENGINES,
    Engine,
    EngineNotReadyError,
    EngineOverloadedError,
    EngineRequestError,
    GenerationRequest,
    SamplingParams,
    create_engine,
)
from data_plane.engine.torch_engine import TorchEngine
from meridian.clock import Clock
from meridian.registry import UnknownName
from meridian.settings.node import NodeSettings


async def test_greedy_is_deterministic(engine: TorchEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a, b = await run_request(engine, "a", params), await run_request(engine, "b", params)
    assert tokens_of(a) == tokens_of(b)
    assert len(tokens_of(a)) == 12
    assert a[-1].finish_reason == "length"
    assert [o.finish_reason for o in a[:-1]] == [None] * (len(a) - 1)
    assert a[-1].completion_tokens == 12 and a[-1].prompt_tokens == len(ENGINE_PROMPT)
    text = "".join(o.text for o in a)
    # Decoded in the prompt's context: the prompt's last token is a lone UTF-8 byte, whose
    # U+FFFD comes out with the first generated token, as in any stream that generated it.
    tok = engine.get_tokenizer()
    assert text == tok.decode(ENGINE_PROMPT + tokens_of(a))[len(tok.decode(ENGINE_PROMPT[:-1])):]


async def test_seeded_sampling_reproduces_even_when_interleaved(engine: TorchEngine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=42, ignore_eos=True)
    alone = tokens_of(await run_request(engine, "alone", params))
    # Running concurrently with other requests must not change a seeded result.
    results = await asyncio.gather(
        run_request(engine, "x", params),
        run_request(engine, "y", SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)),
        run_request(engine, "z", SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)),
    )
    assert tokens_of(results[0]) == alone
    assert tokens_of(results[1]) != alone


async def test_stop_token_ends_the_sequence(engine: TorchEngine) -> None:
    greedy = tokens_of(await run_request(engine, "g", SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True)))
    stop_at = greedy[3]
    out = await run_request(engine, "s", SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=(stop_at,)))
    first = greedy.index(stop_at)
    assert tokens_of(out) == greedy[: first + 1]
    assert out[-1].finish_reason == "stop"


async def test_stop_string_cuts_the_text(engine: TorchEngine) -> None:
    full = "".join(o.text for o in await run_request(engine, "g", SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True)))
    stop = full[8:11]
    out = await run_request(engine, "s", SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,)))
    assert "".join(o.text for o in out) == full[: full.index(stop)]
    assert out[-1].finish_reason == "stop"


async def test_requests_that_cannot_fit_are_refused(engine: TorchEngine) -> None:
    with pytest.raises(EngineRequestError):
        await run_request(engine, "long", SamplingParams(max_tokens=2048))
    with pytest.raises(EngineRequestError):
        await run_request(engine, "empty", SamplingParams(), prompt=[])


async def test_full_queue_is_an_overload_error(tiny_checkpoint: Path) -> None:
    eng = TorchEngine(make_settings(tiny_checkpoint, max_num_seqs=1, max_waiting_requests=1))
    await eng.start()
    try:
        long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        running = eng.generate(GenerationRequest("running", ENGINE_PROMPT, long))
        await anext(running)
        waiting = eng.generate(GenerationRequest("waiting", ENGINE_PROMPT, long))
        waiting_first = asyncio.ensure_future(anext(waiting))
        await eventually(lambda: eng.stats().waiting == 1)
        assert eng.stats().running == 1
        with pytest.raises(EngineOverloadedError):
            await run_request(eng, "rejected", long)
        await running.aclose()
        await waiting_first  # admitted once the running request is gone
        await waiting.aclose()
    finally:
        await eng.stop()


async def test_closing_the_stream_aborts_and_frees_the_request(engine: TorchEngine) -> None:
    gen = engine.generate(GenerationRequest(
        "abandon", ENGINE_PROMPT, SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)))
    await anext(gen)
    assert engine.stats().running == 1
    await gen.aclose()
    await eventually(lambda: engine.stats().running == 0 and engine.stats().requests_aborted_total)
    assert engine.stats().kv_cache_usage == 0.0
    assert engine.stats().generation_tokens_total < 500


async def test_kv_usage_and_counters(engine: TorchEngine) -> None:
    gen = engine.generate(GenerationRequest(
        "kv", ENGINE_PROMPT, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)))
    await anext(gen)
    await eventually(lambda: engine.stats().kv_cache_usage > 0)
    async for _ in gen:
        pass
    stats = engine.stats()
    assert stats.prompt_tokens_total == len(ENGINE_PROMPT)
    assert stats.generation_tokens_total == 100
    assert stats.requests_finished_total == 1
    assert stats.kv_cache_usage == 0.0


async def test_not_started_and_stopped_engines_refuse_work(tiny_checkpoint: Path) -> None:
    eng = TorchEngine(make_settings(tiny_checkpoint))
    with pytest.raises(EngineNotReadyError):
        await run_request(eng, "early", SamplingParams())
    await eng.start()
    await eng.stop()
    with pytest.raises(EngineNotReadyError):
        await run_request(eng, "late", SamplingParams())


async def test_registry_creates_engines_by_name(tiny_checkpoint: Path) -> None:
    settings = make_settings(tiny_checkpoint)
    assert isinstance(create_engine("torch", settings), TorchEngine)
    assert isinstance(create_engine("torch", settings), Engine)

    def factory(s: NodeSettings, *, clock: Clock) -> Engine:
        return TorchEngine(s, clock=clock)

    ENGINES.register("test-alias", factory)
    try:
        assert "test-alias" in ENGINES.names()
        assert isinstance(create_engine("test-alias", settings), TorchEngine)
        with pytest.raises(UnknownName, match="unknown engine 'no-such-engine'"):
            create_engine("no-such-engine", settings)
    finally:
        ENGINES.unregister("test-alias")


async def test_load_failure_surfaces_from_start(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    eng = TorchEngine(make_settings(tmp_path / "broken"))
    with pytest.raises(Exception, match=r"config\.json"):
        await eng.start()


async def test_top_k_one_is_greedy_and_logprobs_describe_the_choice(engine: TorchEngine) -> None:
    greedy = tokens_of(await run_request(engine, "g", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    topk = await run_request(engine, "k", SamplingParams(
        temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True, seed=5, logprobs=3))
    assert tokens_of(topk) == greedy
    entries = [lp for o in topk for lp in (o.logprobs or [])]
    assert [e.token_id for e in entries] == greedy
    for e in entries:
        assert len(e.top) == 3 and e.top[0][0] == e.token_id
        assert e.logprob == pytest.approx(e.top[0][1]) and e.logprob <= 0.0
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)


async def test_a_repeated_prompt_reports_its_cached_prefix(tiny_checkpoint: Path) -> None:
    eng = TorchEngine(make_settings(tiny_checkpoint, block_size=4))
    await eng.start()
    try:
        prompt = list(range(1, 40))
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        first = await run_request(eng, "first", params, prompt=prompt)
        second = await run_request(eng, "second", params, prompt=prompt)
    finally:
        await eng.stop()
    assert first[0].cached_tokens == 0
    assert second[0].cached_tokens == 36  # nine full blocks; the last token is always computed
    assert tokens_of(first) == tokens_of(second)
