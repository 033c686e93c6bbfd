"""The router writes one `meridian.access` line per routed request, with the fields an
operator looks a request up by, for a real request through a real router and node."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tenant_fabric import MODEL, NODE_ID, Tenant, tenant_fabric

from data_plane.model.make_tiny import make_tiny_checkpoint
from meridian.logs import JsonFormatter

ACME = Tenant("acme", "mrd_acme-tenant-key-1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, seed=0)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "meridian.access"]


async def test_each_routed_request_is_one_line_with_its_routing_and_tokens(
        checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="meridian.access")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}
    async with tenant_fabric(checkpoint, [ACME]) as fabric, fabric.client(ACME) as client:
        whole = await client.post("/v1/chat/completions", json=chat, headers={"x-request-id": "req-whole"})
        assert whole.status_code == 200, whole.text
        streamed = await client.post("/v1/chat/completions", headers={"x-request-id": "req-stream"}, json={
            **chat, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200
        refused = await client.post("/v1/chat/completions", json=chat,
                                    headers={"authorization": "Bearer mrd_nobody", "x-request-id": "req-401"})
        assert refused.status_code == 401
        scrape = await client.get("/metrics")
        assert scrape.status_code == 401  # not an inference route: no line either
    lines = {r.request_id: r for r in access_lines(caplog)}  # type: ignore[attr-defined]
    assert set(lines) == {"req-whole", "req-stream", "req-401"}
    usage = whole.json()["usage"]
    w = lines["req-whole"]
    assert (w.route, w.tenant, w.model, w.node, w.status, w.stream) == (  # type: ignore[attr-defined]
        "/v1/chat/completions", "acme", MODEL, NODE_ID, 200, False)
    assert w.region == whole.headers["x-meridian-region"]  # type: ignore[attr-defined]
    assert (w.prompt_tokens, w.completion_tokens) == (  # type: ignore[attr-defined]
        usage["prompt_tokens"], usage["completion_tokens"])
    assert w.latency_ms > 0  # type: ignore[attr-defined]
    s = lines["req-stream"]
    assert (s.stream, s.node, s.status, s.completion_tokens) == (True, NODE_ID, 200, 3)  # type: ignore[attr-defined]
    r = lines["req-401"]
    assert (r.status, r.tenant, r.node) == (401, "", "")  # type: ignore[attr-defined]
    # As JSON, the same fields are the object's.
    obj = json.loads(JsonFormatter().format(w))
    assert obj["logger"] == "meridian.access" and obj["level"] == "INFO"
    assert {k: obj[k] for k in ("request_id", "tenant", "model", "node", "status")} == {
        "request_id": "req-whole", "tenant": "acme", "model": MODEL, "node": NODE_ID, "status": 200}


async def test_the_line_can_be_turned_off(checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="meridian.access")
    async with tenant_fabric(checkpoint, [ACME], router={"access_log": False}) as fabric, \
            fabric.client(ACME) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert r.status_code == 200
    assert access_lines(caplog) == []
