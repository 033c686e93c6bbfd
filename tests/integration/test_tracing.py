"""Traces across router → node → engine (a real torch node behind a real router), exported
over OTLP/HTTP to in-test collectors: one trace id end to end, the client's kept, and each
residency zone's spans at its own collector."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_collector import CollectedSpan, OtlpCollector
from tenant_fabric import MODEL, Tenant, TenantFabric, tenant_fabric

from data_plane.model.make_tiny import make_tiny_checkpoint

EU = Tenant("eurobank", "mrd_eu-tenant-key-trace", zone="eu")
ACME = Tenant("acme", "mrd_global-tenant-key-trace", zone="global")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say something about the sea."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, seed=0)


@pytest.fixture
def collectors() -> Iterator[tuple[OtlpCollector, OtlpCollector]]:
    with OtlpCollector() as default, OtlpCollector() as eu:
        yield default, eu


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


async def flush(fabric: TenantFabric) -> None:
    await asyncio.to_thread(fabric.state.tracing.flush)
    await asyncio.to_thread(fabric.node.state.tracing.flush)


def by_name(spans: list[CollectedSpan]) -> dict[str, CollectedSpan]:
    return {s.name: s for s in spans}


async def test_one_trace_from_router_through_node_to_engine(checkpoint: Path, collectors):
    default, eu = collectors
    tracing = {"otlp_endpoint": default.url, "otlp_zone_endpoints": {"eu": eu.url}}
    async with tenant_fabric(checkpoint, [EU, ACME], node=tracing, router=tracing) as fabric:
        trace_id, client_span, header = traceparent()
        async with fabric.client(ACME) as client:
            r = await client.post("/v1/chat/completions", json=CHAT, headers={"traceparent": header})
        assert r.status_code == 200, r.text
        await flush(fabric)
        default.wait_for(lambda: len(default.trace(trace_id)) >= 5)
        spans = by_name(default.trace(trace_id))
    router, node = spans["router POST /v1/chat/completions"], spans["node POST /v1/chat/completions"]
    generate, prefill, decode = spans["engine generate"], spans["engine prefill"], spans["engine decode"]
    # One trace: the client's span → router → node → engine generate → prefill, decode.
    assert router.parent_span_id == client_span
    assert node.parent_span_id == router.span_id
    assert generate.parent_span_id == node.span_id
    assert prefill.parent_span_id == decode.parent_span_id == generate.span_id
    assert (router.service, node.service, generate.service) == ("meridian-router", "meridian-node", "meridian-node")
    assert (router.scope, node.scope, generate.scope) == ("meridian.router", "meridian.node", "meridian.engine")
    expected = {"meridian.tenant": "acme", "meridian.zone": "global", "meridian.model": MODEL,
                "meridian.region": "gcp:europe-west4", "meridian.node": "eu-node-1",
                "meridian.failover_attempts": 0, "http.response.status_code": 200}
    assert {k: router.attributes.get(k) for k in expected} == expected
    assert node.attributes["meridian.zone"] == "global" == generate.attributes["meridian.zone"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert prefill.attributes["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert eu.spans == []  # nothing of a global tenant's request at the eu collector


async def test_an_eu_tenants_spans_reach_only_the_eu_collector(checkpoint: Path, collectors):
    default, eu = collectors
    tracing = {"otlp_endpoint": default.url, "otlp_zone_endpoints": {"eu": eu.url}}
    async with tenant_fabric(checkpoint, [EU, ACME], node=tracing, router=tracing) as fabric:
        async with fabric.client(EU) as client:
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200, r.text
        # A client's baggage cannot move its spans to another zone's collector.
        trace_id, _, header = traceparent()
        async with fabric.client(EU) as client:
            r = await client.post("/v1/chat/completions", json=CHAT,
                                  headers={"traceparent": header, "baggage": "meridian.zone=global"})
        assert r.status_code == 200
        await flush(fabric)
        eu.wait_for(lambda: len(eu.trace(trace_id)) >= 5)
        eu.wait_for(lambda: len(eu.spans) >= 10)
    assert {s.service for s in eu.spans} == {"meridian-router", "meridian-node"}
    assert {s.scope for s in eu.spans} == {"meridian.router", "meridian.node", "meridian.engine"}
    assert all(s.attributes["meridian.zone"] == "eu" for s in eu.spans)
    assert default.spans == []
