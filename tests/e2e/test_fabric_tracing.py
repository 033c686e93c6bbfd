"""The local fabric as processes (control plane, router, a torch node) with tracing on: one
request from the official OpenAI client is one trace at the in-test OTLP collector, with
spans from the router, the node and the engine under the client's trace id; an eu tenant's
spans go to the eu collector only. The default collector is set in the launcher's own
environment, as `MERIDIAN_ROUTER_OTLP_ENDPOINT=… meridian demo` does: the fabric passes it
on to its children. The same fabric's /metrics pages are scraped for real, with the metrics
token fabric.json records."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import httpx
import openai
import pytest
from e2e_fabric import e2e_spec, running
from otlp_collector import OtlpCollector
from prometheus_client.parser import text_string_to_metric_families

from localfabric import DEMO_MODEL, LocalFabric

pytestmark = pytest.mark.e2e

REGION = "gcp:europe-west4"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def collectors() -> Iterator[tuple[OtlpCollector, OtlpCollector]]:
    with OtlpCollector() as default, OtlpCollector() as eu:
        yield default, eu


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory, collectors) -> Iterator[LocalFabric]:
    default, eu = collectors
    zones = json.dumps({"eu": eu.url})
    # The batch exporter sends every 100 ms instead of every 5 s.
    router_env = {"MERIDIAN_ROUTER_OTLP_ZONE_ENDPOINTS": zones, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    node_env = {"MERIDIAN_NODE_OTLP_ZONE_ENDPOINTS": zones, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    spec = e2e_spec(tmp_path_factory.mktemp("fabric"), regions=(REGION,), default_client_location=REGION,
                    router_env=router_env, node_env=node_env)
    with pytest.MonkeyPatch.context() as env:
        # The launcher's environment: the default collector, and settings the fabric must not
        # pass on (every child would bind this port, advertise this URL).
        env.setenv("MERIDIAN_ROUTER_OTLP_ENDPOINT", default.url)
        env.setenv("MERIDIAN_NODE_OTLP_ENDPOINT", default.url)
        env.setenv("MERIDIAN_ROUTER_METRICS_PORT", "1")
        env.setenv("MERIDIAN_NODE_ADVERTISE_URL", "http://127.0.0.1:1")
        yield from running(spec)


def client(fabric: LocalFabric, zone: str) -> openai.OpenAI:
    assert fabric.info is not None
    return openai.OpenAI(base_url=fabric.info.router_url + "/v1", api_key=fabric.info.keys[zone],
                         max_retries=0, timeout=60)


def test_one_request_is_one_trace_through_router_node_and_engine(fabric: LocalFabric, collectors):
    default, eu = collectors
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    chat = client(fabric, "global").chat.completions.create(
        model=DEMO_MODEL, messages=MESSAGES, max_tokens=4,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert chat.choices[0].message.content is not None
    default.wait_for(lambda: {"router", "node", "engine"} <= {s.scope.split(".")[1] for s in default.trace(trace_id)})
    spans = {s.name: s for s in default.trace(trace_id)}
    router = spans["router POST /v1/chat/completions"]
    node = spans["node POST /v1/chat/completions"]
    assert router.parent_span_id == client_span  # the client's trace id and span are kept
    assert node.parent_span_id == router.span_id
    assert spans["engine generate"].parent_span_id == node.span_id
    assert router.attributes["meridian.region"] == REGION and router.attributes["meridian.zone"] == "global"
    assert router.attributes["meridian.node"] == node.attributes["meridian.node"]
    assert not eu.trace(trace_id)


def test_an_eu_tenants_trace_goes_to_the_eu_collector_only(fabric: LocalFabric, collectors):
    default, eu = collectors
    trace_id = secrets.token_hex(16)
    client(fabric, "eu").chat.completions.create(
        model=DEMO_MODEL, messages=MESSAGES, max_tokens=4,
        extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    eu.wait_for(lambda: {"router", "node", "engine"} <= {s.scope.split(".")[1] for s in eu.trace(trace_id)})
    assert all(s.attributes["meridian.zone"] == "eu" for s in eu.trace(trace_id))
    assert not default.trace(trace_id)


def test_router_and_control_plane_metrics_scraped_from_the_processes(fabric: LocalFabric):
    assert fabric.info is not None
    client(fabric, "eu").chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, max_tokens=2)
    # A scraper reads the metrics token from fabric.json; it is not the cluster token.
    state = json.loads((fabric.spec.work_dir / "fabric.json").read_text())
    assert state["metrics_token"] == fabric.info.metrics_token != fabric.info.cluster_token
    token = {"authorization": f"Bearer {state['metrics_token']}"}
    assert httpx.get(fabric.info.router_url + "/metrics", timeout=10).status_code == 401
    router = httpx.get(fabric.info.router_url + "/metrics", headers=token, timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(router)}
    requests = families["meridian_router_tenant_requests"]
    assert requests.type == "counter"
    assert any(s.labels == {"tenant": "demo-eu", "model": DEMO_MODEL, "zone": "eu", "status": "200"} and s.value >= 1
               for s in requests.samples)
    assert families["meridian_router_routing_table_age_seconds"].type == "gauge"
    cp = httpx.get(fabric.info.control_plane_url + "/metrics", headers=token, timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(cp)}
    nodes = families["meridian_cp_nodes"]
    assert any(s.labels == {"region": REGION, "status": "ready"} and s.value == 1 for s in nodes.samples)
    assert [s.value for s in families["meridian_cp_leader"].samples] == [1]
    assert httpx.get(fabric.info.control_plane_url + "/metrics", timeout=10).status_code == 401
