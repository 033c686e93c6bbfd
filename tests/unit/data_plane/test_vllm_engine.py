"""VllmEngine against the `vllm serve` stand-in (vllm_standin.py): generation, request
mapping, aborts, stats, KV event relay, restarts and draining."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from node_testkit import eventually

from data_plane.engine.base import (
    EngineNotReadyError,
    EngineRequestError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    create_engine,
)
from data_plane.engine.vllm.engine import VllmEngine
from data_plane.engine.vllm.spec import DeploymentSpec
from data_plane.engine.vllm.supervisor import ChildState, VllmFailedError
from meridian.clock import ManualClock
from meridian.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from meridian.settings.node import NodeSettings

STANDIN = Path(__file__).with_name("vllm_standin.py")
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16


class ListSink:
    """A KVEventSink that keeps what it is given (publish runs on the relay thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        with self._lock:
            self._batches.append(batch)

    def events(self) -> list[Any]:
        with self._lock:
            return [e for b in self._batches for e in b.events]

    def stored(self) -> list[BlockStored]:
        return [e for e in self.events() if isinstance(e, BlockStored)]


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MERIDIAN_STANDIN_STATE_DIR", str(tmp_path / "standin"))
    return tmp_path / "standin"


def settings(checkpoint: Path, **overrides: Any) -> NodeSettings:
    values: dict[str, Any] = {
        "model_dir": checkpoint,
        "engine": "vllm",
        "control_plane_url": None,
        "vllm_executable": [sys.executable, str(STANDIN)],
        "vllm_gpu_count": 1,
        "vllm_probe_interval_s": 0.05,
        "vllm_startup_timeout_s": 30.0,
        "vllm_restart_backoff_s": 0.05,
        "vllm_restart_backoff_max_s": 0.2,
        "vllm_stop_grace_s": 5.0,
        "drain_timeout_s": 10.0,
    }
    values.update(overrides)
    return NodeSettings(**values)


@pytest.fixture
async def engine(tiny_checkpoint: Path, state: Path) -> AsyncIterator[VllmEngine]:
    eng = VllmEngine(settings(tiny_checkpoint))
    await eng.start()
    yield eng
    await eng.stop()


async def run(engine: VllmEngine, rid: str, params: SamplingParams | None = None,
              prompt: list[int] = PROMPT, lora: str | None = None) -> list[GenerationOutput]:
    request = GenerationRequest(rid, prompt, params or SamplingParams(max_tokens=4), lora_name=lora)
    return [o async for o in engine.generate(request)]


def requests_seen(state: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state / "requests.jsonl").read_text().splitlines()]


def tokens(outputs: list[GenerationOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_generation_streams_token_ids_text_and_counts(engine: VllmEngine) -> None:
    outputs = await run(engine, "a", SamplingParams(max_tokens=4))
    assert tokens(outputs) == [140, 141, 142, 143]
    assert "".join(o.text for o in outputs) == " w140 w141 w142 w143"
    assert [o.finish_reason for o in outputs] == [None, None, None, "length"]
    assert [o.completion_tokens for o in outputs] == [1, 2, 3, 4]
    assert all(o.prompt_tokens == 40 and o.request_id == "a" for o in outputs)
    assert outputs[-1].cached_tokens == 0
    # The same prompt again: its two full blocks come from vLLM's prefix cache.
    again = await run(engine, "b", SamplingParams(max_tokens=1))
    assert again[-1].cached_tokens == 32


async def test_sampling_parameters_reach_vllm(engine: VllmEngine, state: Path) -> None:
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=8, stop=("w999",),
                            stop_token_ids=(142,), seed=7, ignore_eos=True, logprobs=2)
    request = GenerationRequest("req-1", PROMPT, params, cache_salt="tenant-a")
    outputs = [o async for o in engine.generate(request)]
    (seen,) = requests_seen(state)
    assert seen["request_id"] == "req-1"
    body = seen["body"]
    assert body["prompt"] == PROMPT and body["model"] == "tiny-llama" and body["stream"] is True
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids",
                                 "seed", "ignore_eos", "logprobs", "cache_salt")} == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "max_tokens": 8, "stop": ["w999"],
        "stop_token_ids": [142], "seed": 7, "ignore_eos": True, "logprobs": 2, "cache_salt": "tenant-a"}
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    # Stopped by token 142; logprobs name token ids, the sampled one first.
    assert outputs[-1].finish_reason == "stop" and tokens(outputs) == [140, 141, 142]
    first = outputs[0].logprobs
    assert first is not None and first[0].token_id == 140 and first[0].logprob == -0.25
    assert [t for t, _ in first[0].top] == [140, 141, 142]


async def test_defaults_are_left_to_vllm(engine: VllmEngine, state: Path) -> None:
    outputs = await run(engine, "a", SamplingParams(max_tokens=2))
    assert all(o.logprobs is None for o in outputs)
    body = requests_seen(state)[0]["body"]
    for key in ("top_k", "stop", "stop_token_ids", "seed", "logprobs", "cache_salt"):
        assert key not in body


async def test_lora_requests_name_the_adapter(tiny_checkpoint: Path, state: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_TOKEN_DELAY_S", "0.02")
    spec = DeploymentSpec(name="chat", model="tiny", loras=[{"name": "sql"}], max_loras=2)
    eng = VllmEngine(settings(tiny_checkpoint, lora_modules={"sql": tmp_path / "sql"}), spec=spec)
    assert eng.models() == ["tiny"] and eng.lora_adapters() == ["sql"]
    await eng.start()
    try:
        stream = eng.generate(GenerationRequest("l1", PROMPT, SamplingParams(max_tokens=200), lora_name="sql"))
        await stream.__anext__()
        await eventually(lambda: eng.stats().running_loras == ("sql",))
        assert eng.stats().max_loras == 2
        await stream.aclose()
        assert requests_seen(state)[0]["body"]["model"] == "sql"
        with pytest.raises(EngineRequestError, match="unknown LoRA adapter"):
            await run(eng, "l2", lora="nope")
    finally:
        await eng.stop()


async def test_invalid_requests_fail_on_first_iteration(engine: VllmEngine) -> None:
    with pytest.raises(EngineRequestError, match="empty"):
        await run(engine, "e", prompt=[])
    # The stand-in serves 4096 tokens; the engine read that from /v1/models.
    with pytest.raises(EngineRequestError, match="maximum context length 4096"):
        await run(engine, "long", SamplingParams(max_tokens=4090))
    stream = engine.generate(GenerationRequest("dup", PROMPT, SamplingParams(max_tokens=50)))
    await stream.__anext__()
    with pytest.raises(EngineRequestError, match="already running"):
        await run(engine, "dup")
    await stream.aclose()


async def test_closing_the_iterator_aborts_the_request_in_vllm(
    tiny_checkpoint: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_TOKEN_DELAY_S", "0.02")
    eng = VllmEngine(settings(tiny_checkpoint))
    await eng.start()
    try:
        stream = eng.generate(GenerationRequest("x", PROMPT, SamplingParams(max_tokens=500)))
        await stream.__anext__()
        await eventually(lambda: eng.stats().running == 1)
        await stream.aclose()
        await eventually(lambda: eng.stats().requests_aborted_total == 1 and eng.stats().running == 0)
        # abort() ends a stream with an "abort" output.
        stream = eng.generate(GenerationRequest("y", PROMPT, SamplingParams(max_tokens=500)))
        await stream.__anext__()
        eng.abort("y")
        rest = [o async for o in stream]
        assert rest[-1].finish_reason == "abort"
        await eventually(lambda: eng.stats().requests_aborted_total == 2)
    finally:
        await eng.stop()


async def test_an_old_vllm_without_token_ids_gets_them_through_logprobs(
    tiny_checkpoint: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_NO_TOKEN_IDS", "1")
    eng = VllmEngine(settings(tiny_checkpoint))
    await eng.start()
    try:
        first = await run(eng, "a", SamplingParams(max_tokens=3))
        # Counts still come from the usage vLLM streams with every chunk.
        assert first[-1].completion_tokens == 3 and first[-1].finish_reason == "length"
        second = await run(eng, "b", SamplingParams(max_tokens=3))
        assert tokens(second) == [140, 141, 142]
        assert all(o.logprobs is None for o in second)
        assert requests_seen(state)[1]["body"]["logprobs"] == 0
    finally:
        await eng.stop()


async def test_stats_and_raw_metrics_come_from_vllm(engine: VllmEngine) -> None:
    await run(engine, "a", SamplingParams(max_tokens=5))
    await eventually(lambda: engine.stats().generation_tokens_total == 5)
    stats = engine.stats()
    assert stats.prompt_tokens_total == 40 and stats.prefix_cache_queries_total == 40
    assert stats.requests_finished_total == 1 and stats.kv_cache_usage > 0
    text = await engine.raw_metrics()
    assert "vllm:generation_tokens_total" in text
    trimmed = await engine.raw_metrics(drop_families=["vllm:num_requests_running"])
    assert "vllm:num_requests_running" not in trimmed and "vllm:num_requests_waiting" in trimmed


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_kv_events_reach_the_sink(tiny_checkpoint: Path, state: Path, monkeypatch: pytest.MonkeyPatch,
                                        encoding: str) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_KV_ENCODING", encoding)
    eng = VllmEngine(settings(tiny_checkpoint))
    sink = ListSink()
    eng.set_kv_event_sink(sink)
    await eng.start()
    try:
        # vLLM's publisher connects to our socket; until the subscription reaches it,
        # events are dropped, as with vLLM itself.
        for i in range(1, 100):
            await run(eng, f"r{i}", SamplingParams(max_tokens=1), prompt=list(range(i * 100, i * 100 + 40)))
            await asyncio.sleep(0.02)
            if sink.stored():
                break
        (event,) = sink.stored()[-1:]
        assert event.block_size == 16 and len(event.block_hashes) == 2 and event.medium == "GPU"
        assert event.token_ids == requests_seen(state)[-1]["body"]["prompt"][:32]
    finally:
        await eng.stop()


async def test_missed_kv_events_are_replayed(tiny_checkpoint: Path, state: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_DROP_SEQ", "2")
    eng = VllmEngine(settings(tiny_checkpoint))
    sink = ListSink()
    eng.set_kv_event_sink(sink)
    await eng.start()
    try:
        await run(eng, "warm", SamplingParams(max_tokens=1), prompt=list(range(1, 17)))
        await eventually(lambda: len(sink.stored()) == 1)  # seq 0 arrived: subscribed
        for i in (1, 2, 3):  # seq 2 is published only to the replay buffer
            await run(eng, f"r{i}", SamplingParams(max_tokens=1), prompt=[i] * 16)
        await eventually(lambda: len(sink.stored()) == 4)
        assert [e.token_ids[0] for e in sink.stored()] == [1, 1, 2, 3]
        assert eng.relay is not None and eng.relay.replayed == 1
    finally:
        await eng.stop()


async def test_a_crashed_vllm_is_restarted_and_its_cache_reported_gone(
    tiny_checkpoint: Path, state: Path
) -> None:
    eng = VllmEngine(settings(tiny_checkpoint, vllm_restart_backoff_s=0.5))
    sink = ListSink()
    eng.set_kv_event_sink(sink)
    await eng.start()
    try:
        await run(eng, "a", SamplingParams(max_tokens=3))
        await eventually(lambda: eng.stats().generation_tokens_total == 3)
        assert eng.supervisor is not None
        eng.supervisor.kill()
        await eventually(lambda: eng.supervisor is not None and eng.supervisor.state is not ChildState.READY)
        with pytest.raises(EngineNotReadyError):
            await run(eng, "during")
        await eventually(lambda: isinstance((sink.events() or [None])[-1], AllBlocksCleared))
        await eventually(lambda: eng.supervisor is not None and eng.supervisor.ready, within=10)
        assert eng.supervisor.restarts == 1
        outputs = await run(eng, "after", SamplingParams(max_tokens=2))
        assert tokens(outputs) == [140, 141]
        # Counters keep counting across vLLM processes.
        await eventually(lambda: eng.stats().generation_tokens_total == 5)
    finally:
        await eng.stop()


async def test_a_request_in_flight_when_vllm_dies_fails_retryably(
    tiny_checkpoint: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_CRASH_AFTER", "1")
    eng = VllmEngine(settings(tiny_checkpoint))
    await eng.start()
    try:
        with pytest.raises(EngineNotReadyError, match="lost the connection"):
            await run(eng, "doomed", SamplingParams(max_tokens=10))
        sup = eng.supervisor
        assert sup is not None
        await eventually(lambda: sup.ready and sup.generation == 2)
        assert tokens(await run(eng, "next", SamplingParams(max_tokens=1))) == [140]
    finally:
        await eng.stop()


async def test_the_node_is_told_when_vllm_cannot_be_kept_up(
    tiny_checkpoint: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_FAIL_FROM", "2")
    eng = VllmEngine(settings(tiny_checkpoint, vllm_max_restarts=1))
    fatal: list[BaseException] = []
    eng.on_fatal = fatal.append
    await eng.start()
    try:
        assert eng.supervisor is not None
        eng.supervisor.kill()
        await eventually(lambda: bool(fatal))
        assert isinstance(fatal[0], VllmFailedError)
        with pytest.raises(EngineNotReadyError):
            await run(eng, "a")
    finally:
        await eng.stop()


async def test_start_fails_when_vllm_never_comes_up(tiny_checkpoint: Path, state: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_FAIL_STARTS", "99")
    eng = VllmEngine(settings(tiny_checkpoint, vllm_max_restarts=1))
    with pytest.raises(VllmFailedError, match="fails on purpose"):
        await eng.start()
    with pytest.raises(EngineNotReadyError):
        await run(eng, "a")
    await eng.stop()


async def test_stop_drains_in_flight_requests(tiny_checkpoint: Path, state: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_TOKEN_DELAY_S", "0.02")
    eng = VllmEngine(settings(tiny_checkpoint))
    await eng.start()
    stream = eng.generate(GenerationRequest("long", PROMPT, SamplingParams(max_tokens=20)))
    first = await stream.__anext__()
    stopping = asyncio.create_task(eng.stop())
    await eventually(lambda: not eng._accepting)
    with pytest.raises(EngineNotReadyError):
        await run(eng, "late")
    rest = [o async for o in stream]
    assert rest[-1].finish_reason == "length" and len(tokens([first, *rest])) == 20
    await stopping
    assert eng.supervisor is not None and eng.supervisor.state is ChildState.STOPPED


async def test_stop_aborts_what_outlives_the_drain_timeout(tiny_checkpoint: Path, state: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_TOKEN_DELAY_S", "0.02")
    clock = ManualClock()
    eng = VllmEngine(settings(tiny_checkpoint, drain_timeout_s=0.2), clock=clock)
    await eng.start()
    stream = eng.generate(GenerationRequest("endless", PROMPT, SamplingParams(max_tokens=2000)))
    await stream.__anext__()
    stopping = asyncio.create_task(eng.stop())
    # The drain timeout passes on the engine's clock, long before the request would end.
    await eventually(stopping.done, within=30.0, clock=clock, step=0.2)
    rest = [o async for o in stream]
    assert rest[-1].finish_reason == "abort"
    await stopping


async def test_created_by_name_with_a_full_featured_spec(tiny_checkpoint: Path, state: Path,
                                                        tmp_path: Path) -> None:
    spec = {"name": "chat", "model": "tiny", "served_model_name": "tiny-chat", "max_model_len": 256,
            "block_size": 32, "quantization": "fp8", "kv_cache_dtype": "fp8", "enforce_eager": True,
            "loras": [{"name": "sql"}], "max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 4,
            "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    eng = create_engine("vllm", settings(tiny_checkpoint, deployment_spec_file=spec_file,
                                         lora_modules={"sql": tmp_path / "sql"}))
    assert isinstance(eng, VllmEngine)
    with pytest.raises(EngineNotReadyError):
        eng.get_tokenizer()
    # The stand-in parses every flag like `vllm serve` does and refuses unknown ones.
    await eng.start()
    try:
        assert eng.models() == ["tiny-chat"]
        assert eng.get_tokenizer().encode("hello")
        with pytest.raises(EngineRequestError, match="maximum context length 256"):
            await run(eng, "a", SamplingParams(max_tokens=250))
        outputs = await run(eng, "b", SamplingParams(max_tokens=1), lora="sql")
        assert outputs[-1].finish_reason == "length"
    finally:
        await eng.stop()
