"""The router's spans and the trace context it hands nodes (real router, stand-in nodes,
an in-test OTLP collector)."""

from __future__ import annotations

import asyncio
import secrets

import httpx
from otlp_collector import OtlpCollector
from router_harness import (
    GLOBAL_KEY,
    MODEL,
    NodeBehaviour,
    ServerGroup,
    make_table,
    node,
    node_app,
    router_settings,
)

from geo_router import create_app
from geo_router.state.table import StaticTableSource

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


async def routed(otlp: str | None, behaviours: dict[str, NodeBehaviour], headers: dict[str, str],
                 body: dict[str, object] = CHAT, key: str = GLOBAL_KEY) -> httpx.Response:
    """One request through a router (tracing to `otlp`, or off) in front of `behaviours`' nodes;
    its spans flushed before it stops."""
    servers = ServerGroup()
    try:
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        # Both nodes in one region: the nearest first, the other its failover.
        table = make_table([node(name, url, region="us").model_copy(update={"node_id": name})
                            for name, url in urls.items()])
        app = create_app(router_settings(otlp_endpoint=otlp, routing_policy="round-robin"),
                         table_source=StaticTableSource(table))
        url = await servers.start(app)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}", **headers}) as c:
            r = await c.post("/v1/chat/completions", json=body)
        await asyncio.to_thread(app.state.router.tracing.flush)
        return r
    finally:
        await servers.stop()


async def test_with_tracing_off_no_trace_context_reaches_the_node():
    b = NodeBehaviour("a")
    _, _, header = traceparent()
    r = await routed(None, {"a": b}, {"traceparent": header, "baggage": "meridian.zone=eu"})
    assert r.status_code == 200
    assert "traceparent" not in b.headers[0] and "baggage" not in b.headers[0]


async def test_the_router_span_continues_the_clients_trace_across_a_failover():
    failing, healthy = NodeBehaviour("a", mode="error500"), NodeBehaviour("b")
    trace_id, client_span, header = traceparent()
    with OtlpCollector() as collector:
        r = await routed(collector.url, {"a": failing, "b": healthy},
                         {"traceparent": header, "baggage": "meridian.zone=eu,other=1"})
        assert r.status_code == 200
        collector.wait_for(lambda: bool(collector.trace(trace_id)))
    (span,) = collector.trace(trace_id)
    assert span.parent_span_id == client_span
    attempts = failing.hits + healthy.hits
    assert (attempts, span.attributes["meridian.node"]) == (2, "b")
    assert span.attributes["meridian.failover_attempts"] == 1
    assert span.attributes["meridian.zone"] == "global"  # the key's zone, not the client's baggage
    # Both attempts carried this span as the parent, and the tenant's zone as the only baggage.
    for b in (failing, healthy):
        assert b.headers[0]["traceparent"] == f"00-{trace_id}-{span.span_id}-01"
        assert b.headers[0]["baggage"] == "meridian.zone=global"


async def test_a_refused_request_is_a_span_without_a_tenant():
    trace_id, _, header = traceparent()
    with OtlpCollector() as collector:
        r = await routed(collector.url, {"a": NodeBehaviour("a")}, {"traceparent": header}, key="mrd_nobody")
        assert r.status_code == 401
        collector.wait_for(lambda: bool(collector.trace(trace_id)))
    (span,) = collector.trace(trace_id)
    assert span.attributes["http.response.status_code"] == 401
    assert "meridian.tenant" not in span.attributes and "meridian.zone" not in span.attributes
