"""A node running the vLLM adapter looks like a torch node from outside: the same
OpenAI API, and one /metrics page with each vLLM family once (vLLM's own relayed)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from node_testkit import asgi_client, eventually
from prometheus_client.parser import text_string_to_metric_families
from router_harness import ServerGroup
from test_vllm_engine import settings

from data_plane.server.app import create_app


@pytest.fixture
def standin_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MERIDIAN_STANDIN_STATE_DIR", str(tmp_path / "standin"))
    return tmp_path / "standin"


async def test_vllm_node_serves_openai_and_relays_vllm_metrics(
    tiny_checkpoint: Path, standin_state: Path
) -> None:
    app = create_app(settings(tiny_checkpoint))
    async with asgi_client(app) as client:
        resp = await client.post("/v1/completions", json={
            "model": "tiny-llama", "prompt": list(range(100, 140)), "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
        metrics = (await client.get("/metrics")).text
    names = [f.name for f in text_string_to_metric_families(metrics)]
    assert len(names) == len(set(names)), "a metric family appears twice"
    assert "vllm:num_requests_running" in names
    assert "vllm:engine_sleep_state" in names


async def test_node_reports_failed_when_vllm_cannot_be_kept_up(
    tiny_checkpoint: Path, standin_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_STANDIN_FAIL_FROM", "2")
    app = create_app(settings(tiny_checkpoint, vllm_max_restarts=1))
    fatal: list[BaseException] = []
    app.state.runtime.on_fatal = fatal.append
    async with asgi_client(app) as client:
        assert (await client.get("/health")).status_code == 200
        app.state.runtime.engine.supervisor.kill()
        await eventually(lambda: bool(fatal))
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"


async def _aborted(base_url: str) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_hangs_up_is_aborted_in_vllm(
    tiny_checkpoint: Path, standin_state: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The node closes its connection to vLLM when its client leaves, which is what makes
    vLLM abort: mid-stream, and while a whole answer is generated (vLLM sends its head only
    once the answer is whole, so the node watches its client from the start)."""
    monkeypatch.setenv("MERIDIAN_STANDIN_TOKEN_DELAY_S", "0.02")  # 200 tokens: 4 s
    app = create_app(settings(tiny_checkpoint))
    servers = ServerGroup()
    try:
        url = await servers.start(app)
        await app.state.runtime.wait_ready()
        vllm = app.state.runtime.engine.base_url
        body = {"model": "tiny-llama", "prompt": list(range(100, 140)), "max_tokens": 200, "stream": stream}
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break  # the first event, then hang up
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/v1/completions", json=body, timeout=0.3)
        await eventually(lambda: app.state.runtime.lifecycle.in_flight == 0, within=3.0)
        assert await _aborted(vllm) == 1
    finally:
        await servers.stop()


async def test_pass_through_keeps_bodies_as_sent_and_names_models_as_vllm_does(
    tiny_checkpoint: Path, standin_state: Path
) -> None:
    app = create_app(settings(tiny_checkpoint))
    async with asgi_client(app) as client:
        unknown = await client.post("/v1/completions", json={"model": "no-such-model", "prompt": [1], "max_tokens": 1})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        garbage = await client.post("/v1/completions", content=b"{not json")
        assert garbage.status_code == 400
        # An empty body (a cancel) reaches vLLM as it is: the stand-in has no such route.
        cancel = await client.post("/v1/responses/resp_1/cancel")
        assert cancel.status_code == 404 and cancel.json() == {"detail": "Not Found"}
        card = await client.get("/v1/models/tiny-llama")
        assert card.status_code == 200 and card.json()["id"] == "tiny-llama"


async def test_a_tracing_vllm_node_feeds_vllm_its_span_and_the_collector(
    tiny_checkpoint: Path, standin_state: Path
) -> None:
    """vLLM is started with --otlp-traces-endpoint (OTLP/HTTP) and each passed-through request
    carries the node span's traceparent, so vLLM's own spans join the router's trace."""
    import json
    import secrets

    from otlp_collector import OtlpCollector

    trace_id, router_span = secrets.token_hex(16), secrets.token_hex(8)
    with OtlpCollector() as collector:
        app = create_app(settings(tiny_checkpoint, otlp_endpoint=collector.url))
        async with asgi_client(app) as client:
            resp = await client.post(
                "/v1/completions", json={"model": "tiny-llama", "prompt": list(range(100, 140)), "max_tokens": 3},
                headers={"traceparent": f"00-{trace_id}-{router_span}-01", "baggage": "meridian.zone=eu"})
            assert resp.status_code == 200, resp.text
            assert app.state.tracing.flush()
        collector.wait_for(lambda: bool(collector.trace(trace_id)))
    (node,) = collector.trace(trace_id)
    assert node.name == "node POST /v1/completions" and node.parent_span_id == router_span
    assert node.attributes["meridian.zone"] == "eu"
    argv = json.loads((standin_state / "argv-1.json").read_text())
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == f"{collector.url}/v1/traces"
    (seen,) = [json.loads(line) for line in (standin_state / "requests.jsonl").read_text().splitlines()]
    assert seen["traceparent"] == f"00-{trace_id}-{node.span_id}-01"
    assert seen["otlp_protocol"] == "http/protobuf"
