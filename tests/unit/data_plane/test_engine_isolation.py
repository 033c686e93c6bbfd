"""One request can never fail its neighbours in the torch engine: sampling values that
underflow float32, a row that cannot be sampled, a forward pass that breaks on one
sequence. Each fails that request alone (as a request error) or is served; the requests
batched with it always finish (issue 18, finding 1)."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_testkit import run_request

from data_plane.engine.base import EngineRequestError, GenerationOutput, SamplingParams
from data_plane.engine.scheduler import SchedulerOutput
from data_plane.engine.torch_engine import TorchEngine

NEIGHBOUR = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3)




async def alongside(engine: TorchEngine, rid: str, params: SamplingParams) -> tuple[object, list[GenerationOutput]]:
    """Run `params` while a neighbour's generation is under way; (its outcome, the neighbour's outputs)."""
    neighbour = asyncio.create_task(run_request(engine, f"{rid}-neighbour", NEIGHBOUR))
    await asyncio.sleep(0)  # the neighbour is submitted first, so both share steps
    try:
        outcome: object = await run_request(engine, rid, params)
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
    greedy = await run_request(engine, "greedy", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
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
        await run_request(engine, "bad", params)


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
    after = await run_request(engine, "after", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert after[-1].completion_tokens == 3


async def test_a_seeded_neighbour_is_unchanged_by_a_failing_request(engine: TorchEngine) -> None:
    alone = [t for o in await run_request(engine, "alone", NEIGHBOUR) for t in o.token_ids]
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
async def test_fuzzed_sampling_values_fail_alone_or_are_served(
    engine: TorchEngine, temperature: float, top_p: float, top_k: int, seed: int | None
) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            max_tokens=3, ignore_eos=True)
    outcome, neighbour = await alongside(engine, "fuzz", params)
    assert neighbour[-1].finish_reason == "length", "the neighbour was failed"
    if isinstance(outcome, list):
        assert outcome[-1].finish_reason == "length" and outcome[-1].completion_tokens == 3
    else:
        assert isinstance(outcome, EngineRequestError)
