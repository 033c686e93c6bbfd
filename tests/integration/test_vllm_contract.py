"""The contract the vLLM adapter relies on, run against the stand-in (tests/unit/data_plane/
vllm_standin.py, which the unit tests use in vLLM's place) and against real vLLM (its CPU
build) alike: a stand-in that drifts from vLLM fails here.

Each server is started the way a node starts it (VllmEngine: the argv, the supervisor,
the KV event relay) and then spoken to over HTTP as the adapter and the pass-through do.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from promql_names import dashboard_queries, exported_names, metric_names, vllm_relayed_names
from vllm_fabric import make_vllm_checkpoint, require_vllm, write_spec

from data_plane.engine.base import GenerationRequest, SamplingParams
from data_plane.engine.vllm.engine import VllmEngine
from meridian.kv_events import BlockStored, KVEventBatch
from meridian.settings.node import NodeSettings

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

MODEL = "tiny-llama"
ADAPTER = "sql"
STANDIN = Path(__file__).parents[1] / "unit" / "data_plane" / "vllm_standin.py"
OBSERVABILITY = Path(__file__).parents[2] / "observability"
PROMPT = list(range(100, 400))  # 300 tokens: whole blocks at 16 (stand-in) and 128 (vLLM's CPU build)


def dashboard_vllm_queries() -> list[str]:
    return [expr for path in sorted((OBSERVABILITY / "grafana").glob("*.json"))
            for exprs in dashboard_queries(json.loads(path.read_text()), path.name).values() for expr in exprs]


class Sink:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        with self._lock:
            self.batches.append(batch)

    def stored(self) -> list[BlockStored]:
        with self._lock:
            return [e for b in self.batches for e in b.events if isinstance(e, BlockStored)]


class Server:
    def __init__(self, engine: VllmEngine, sink: Sink) -> None:
        self.engine = engine
        self.sink = sink
        self.http = httpx.AsyncClient(base_url=engine.base_url, timeout=120)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["standin", "vllm"])
async def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    root = tmp_path_factory.mktemp(request.param)
    checkpoint, adapter = make_vllm_checkpoint(root)
    values: dict[str, Any] = {
        "model_dir": checkpoint, "engine": "vllm", "control_plane_url": None,
        "deployment_spec_file": write_spec(root / "spec.json", extra_args=[], max_num_seqs=4, max_model_len=1024),
        "lora_modules": {ADAPTER: adapter}, "vllm_startup_timeout_s": 300.0, "vllm_max_restarts": 0,
        "vllm_probe_interval_s": 0.2,
    }
    if request.param == "standin":
        values |= {"vllm_executable": [sys.executable, str(STANDIN)], "vllm_gpu_count": 1}
    else:
        require_vllm()
        values |= {"vllm_executable": "auto", "vllm_gpu_count": 0}
    engine = VllmEngine(NodeSettings(**values))
    sink = Sink()
    engine.set_kv_event_sink(sink)
    await engine.start()
    server = Server(engine, sink)
    try:
        yield server
    finally:
        await server.http.aclose()
        await engine.stop()


async def test_models_lists_the_served_name_and_each_adapter_with_its_parent(server: Server) -> None:
    cards = {c["id"]: c for c in (await server.http.get("/v1/models")).json()["data"]}
    assert cards[MODEL]["max_model_len"] == 1024
    assert cards[ADAPTER]["parent"] == MODEL


async def test_a_streamed_completion_reports_token_ids_usage_and_its_finish(server: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True, "return_token_ids": True,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ids: list[int] = []
    finishes: list[str] = []
    usage: dict[str, Any] = {}
    async with server.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
    assert len(ids) == 5 and finishes == ["length"]
    assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == 5


async def test_a_whole_completion_and_the_engine_path_agree(server: Server) -> None:
    whole = (await server.http.post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})).json()
    assert whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] == 4
    assert whole["choices"][0]["finish_reason"] == "length"
    outs = [o async for o in server.engine.generate(GenerationRequest(
        "contract-1", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))]
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 4
    assert sum(len(o.token_ids) for o in outs) == 4


async def test_refusals_are_openai_errors_with_the_right_status(server: Server) -> None:
    unknown = await server.http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 1})
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]
    too_long = await server.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2000})
    assert too_long.status_code == 400 and too_long.json()["error"]["message"]


async def test_metrics_carry_the_families_the_fabric_reads(server: Server) -> None:
    text = (await server.http.get("/metrics")).text
    names = {f.name for f in text_string_to_metric_families(text)}
    for family in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
                   "vllm:prefix_cache_hits", "vllm:request_success"):
        assert family in names, f"{family} missing"


async def test_metrics_carry_every_vllm_name_the_dashboards_read(server: Server) -> None:
    # A vLLM node exports its engine's gauges itself and relays the rest of vLLM's page, so
    # every vllm:* name on the dashboards (observability/grafana) must be on vLLM's page.
    read = {name for expr in dashboard_vllm_queries() for name in metric_names(expr) if name.startswith("vllm:")}
    assert vllm_relayed_names() <= read
    exported = exported_names((await server.http.get("/metrics")).text)
    assert read - exported == set()


async def test_kv_events_carry_each_blocks_tokens_and_size(server: Server) -> None:
    await server.http.post("/v1/completions", json={"model": MODEL, "prompt": [7, *PROMPT], "max_tokens": 1})
    for _ in range(200):
        stored = [e for e in server.sink.stored() if e.token_ids[:1] == [7]]
        if stored:
            break
        await asyncio.sleep(0.05)
    assert stored, "no BlockStored for the prompt"
    event = stored[0]
    assert event.block_size in (16, 128) and len(event.token_ids) == event.block_size * len(event.block_hashes)
    assert event.token_ids == [7, *PROMPT][: len(event.token_ids)]
