"""One request can never fail its neighbours in the torch engine: sampling values that
underflow float32, a row that cannot be sampled, a forward pass that breaks on one
sequence. Each fails that request alone (as a request error) or is served; the requests
batched with it always finish (issue 18, finding 1)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_testkit import make_settings

from data_plane.engine.base import EngineRequestError, GenerationOutput, GenerationRequest, SamplingParams
from data_plane.engine.scheduler import SchedulerOutput
from data_plane.engine.torch_engine import TorchEngine

PROMPT = [0, 264, 519, 388, 12, 99]
NEIGHBOUR = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3)


@pytest.fixture
async def engine(tiny_checkpoint: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(make_settings(tiny_checkpoint, max_num_seqs=8))
    await eng.start()
    yield eng
    await eng.stop()


async def run(engine: TorchEngine, rid: str, params: SamplingParams,
              prompt: list[int] = PROMPT) -> list[GenerationOutput]:
    return [o async for o in engine.generate(GenerationRequest(rid, prompt, params))]


async def alongside(engine: TorchEngine, rid: str, params: SamplingParams) -> tuple[object, list[GenerationOutput]]:
    """Run `params` while a neighbour's generation is under way; (its outcome, the neighbour's outputs)."""
    neighbour = asyncio.create_task(run(engine, f"{rid}-neighbour", NEIGHBOUR))
    await asyncio.sleep(0)  # the neighbour is submitted first, so both share steps
    try:
        outcome: object = await run(engine, rid, params)
    except EngineRequestError as exc:
        outcome = exc
    return outcome, await neighbour


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-300, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=5e-324, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1e-45, top_p=1e-300, top_k=1, max_tokens=8, ignore_eos=True),
], ids=["temperature-1e-300", "temperature-subnormal", "top_p-1e-300", "all-tiny"])
async def test_underflowing_sampling_values_are_served_and_spare_the_batch(
    engine: TorchEngine, params: SamplingParams
) -> None:
    outcome, neighbour = await alongside(engine, "tiny", params)
    greedy = await run(engine, "greedy", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    # A temperature under vLLM's epsilon is greedy; a nucleus keeps at least its top token.
    assert isinstance(outcome, list), outcome
    assert [t for o in outcome for t in o.token_ids] == [t for o in greedy for t in o.token_ids]
    assert neighbour[-1].finish_reason == "length" and neighbour[-1].completion_tokens == 24


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=math.nan), SamplingParams(temperature=math.inf),
    SamplingParams(temperature=-1.0), SamplingParams(top_p=0.0), SamplingParams(top_p=math.nan),
    SamplingParams(top_p=1.5), SamplingParams(top_k=-3),
], ids=["t-nan", "t-inf", "t-neg", "p-zero", "p-nan", "p-big", "k-neg"])
async def test_impossible_sampling_values_are_a_request_error(engine: TorchEngine, params: SamplingParams) -> None:
    with pytest.raises(EngineRequestError):
        await run(engine, "bad", params)


async def test_a_forward_pass_broken_by_one_sequence_fails_only_that_sequence(engine: TorchEngine) -> None:
    runner = engine._runner
    assert runner is not None
    execute = runner.execute

    def breaks_on_poison(step: SchedulerOutput):  # type: ignore[no-untyped-def]
        if any(c.seq.request_id == "poison" for c in step.chunks):
            raise RuntimeError("index out of range in self")
        return execute(step)

    runner.execute = breaks_on_poison  # type: ignore[method-assign]
    outcome, neighbour = await alongside(engine, "poison", SamplingParams(temperature=0.0, max_tokens=4))
    assert isinstance(outcome, EngineRequestError)
    assert neighbour[-1].finish_reason == "length" and neighbour[-1].completion_tokens == 24
    # The engine is still healthy: the next request is served.
    after = await run(engine, "after", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert after[-1].completion_tokens == 3


async def test_a_seeded_neighbour_is_unchanged_by_a_failing_request(engine: TorchEngine) -> None:
    alone = [t for o in await run(engine, "alone", NEIGHBOUR) for t in o.token_ids]
    _, neighbour = await alongside(engine, "nan", SamplingParams(temperature=1e-300, top_p=1e-300))
    assert [t for o in neighbour for t in o.token_ids] == alone


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.0, max_value=1e-30, allow_subnormal=True),
    st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-5, 0.999999, 1.0, 2.0]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=floats, top_p=floats, top_k=st.integers(min_value=-5, max_value=70_000),
       seed=st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1)))
def test_fuzzed_sampling_values_fail_alone_or_are_served(
    tiny_checkpoint: Path, temperature: float, top_p: float, top_k: int, seed: int | None
) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            max_tokens=3, ignore_eos=True)

    async def check() -> None:
        outcome, neighbour = await alongside(await shared_engine(tiny_checkpoint), "fuzz", params)
        assert neighbour[-1].finish_reason == "length", "the neighbour was failed"
        if isinstance(outcome, list):
            assert outcome[-1].finish_reason == "length" and outcome[-1].completion_tokens == 3
        else:
            assert isinstance(outcome, EngineRequestError)

    _LOOP.run_until_complete(check())


# Hypothesis drives a plain function, so the fuzz keeps one engine on one loop for all examples.
_LOOP = asyncio.new_event_loop()
_ENGINES: dict[Path, TorchEngine] = {}


async def shared_engine(checkpoint: Path) -> TorchEngine:
    if checkpoint not in _ENGINES:
        eng = TorchEngine(make_settings(checkpoint, max_num_seqs=8))
        await eng.start()
        _ENGINES[checkpoint] = eng
    return _ENGINES[checkpoint]


def teardown_module() -> None:
    for eng in _ENGINES.values():
        _LOOP.run_until_complete(eng.stop())
    _LOOP.close()
