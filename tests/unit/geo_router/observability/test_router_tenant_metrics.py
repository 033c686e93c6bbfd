"""The router's per-tenant metrics, counter types and table staleness, scraped from a real
router (uvicorn, stand-in nodes), and its admin listener for /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    SCRAPE,
    STREAM_USAGE,
    Fabric,
    NodeBehaviour,
    ServerGroup,
    StandInControlPlane,
    eventually,
    make_table,
    metric,
    node,
    node_app,
    reserve_port,
    router_settings,
)

from geo_router import create_app
from geo_router.observability.admin_listener import admin_config, create_metrics_app
from geo_router.state.table import RoutingTableClient, StaticTableSource
from meridian.clock import ManualClock
from meridian.ports import free_port

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TYPES = {
    "meridian_router_tenant_requests": "counter",
    "meridian_router_tenant_tokens": "counter",
    "meridian_router_imbalance_fallbacks": "counter",
    "meridian_router_routing_table_age_seconds": "gauge",
    "meridian_router_routing_table_version": "gauge",
}


async def scrape(f: Fabric) -> str:
    r = await f.client(None).get("/metrics", headers=SCRAPE)
    assert r.status_code == 200, r.text
    return r.text


async def test_tenant_requests_and_tokens_are_counted_by_tenant_model_and_zone(fabric: Fabric):
    acme, eurobank = fabric.client(GLOBAL_KEY), fabric.client(EU_KEY)
    for _ in range(2):
        assert (await acme.post("/v1/chat/completions", json=CHAT)).status_code == 200
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with eurobank.stream("POST", "/v1/chat/completions", json=stream) as r:
        assert r.status_code == 200
        await r.aread()
    # A made-up model is refused; its name never becomes a label.
    assert (await acme.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model"})).status_code == 404

    text = await scrape(fabric)
    requests, tokens = "meridian_router_tenant_requests_total", "meridian_router_tenant_tokens_total"
    assert metric(text, requests, tenant="acme", model=MODEL, zone="global", status="200") == 2
    assert metric(text, requests, tenant="eurobank", model=MODEL, zone="eu", status="200") == 1
    assert metric(text, requests, tenant="acme", model="", zone="global", status="404") == 1
    assert "no-such-model" not in text
    # The stand-in node reports 3 + 3 per answer; the stream's usage chunk 1000 + 2000.
    assert metric(text, tokens, tenant="acme", model=MODEL, zone="global", kind="prompt") == 6
    assert metric(text, tokens, tenant="acme", model=MODEL, zone="global", kind="completion") == 6
    assert metric(text, tokens, tenant="eurobank", model=MODEL, zone="eu", kind="prompt") == STREAM_USAGE["prompt_tokens"]
    assert metric(text, tokens, tenant="eurobank", model=MODEL, zone="eu",
                  kind="completion") == STREAM_USAGE["completion_tokens"]
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {name: families.get(name) for name in TYPES} == TYPES
    # A static table is as current as it gets.
    assert metric(text, "meridian_router_routing_table_age_seconds") == 0
    assert metric(text, "meridian_router_imbalance_fallbacks_total") == 0


async def test_a_stream_without_usage_counts_its_events_and_prompt_estimate(fabric: Fabric):
    async with fabric.client().stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        await r.aread()
    text = await scrape(fabric)
    tokens = "meridian_router_tenant_tokens_total"
    assert metric(text, tokens, tenant="acme", model=MODEL, zone="global", kind="completion") == 3
    assert metric(text, tokens, tenant="acme", model=MODEL, zone="global", kind="prompt") == 1  # "hi": 2 chars


async def test_table_age_grows_while_the_control_plane_is_unreachable():
    clock = ManualClock()
    cp = StandInControlPlane(make_table([]))
    servers = ServerGroup()
    try:
        async with cp.serving() as cp_url:
            settings = router_settings(control_plane_url=cp_url, table_poll_timeout_s=0.2)
            source = RoutingTableClient(settings, retry_base_s=0.05, retry_max_s=0.2, clock=clock)
            url = await servers.start(create_app(settings, table_source=source, clock=clock))
            async with httpx.AsyncClient(base_url=url, headers=SCRAPE) as http:
                text = (await http.get("/metrics")).text
                assert metric(text, "meridian_router_routing_table_age_seconds") == 0
        # The control plane is gone: polls fail and the table in use ages on the app's clock.
        await eventually(lambda: clock.sleepers >= 1)
        clock.advance(45)
        async with httpx.AsyncClient(base_url=url, headers=SCRAPE) as http:
            text = (await http.get("/metrics")).text
        assert metric(text, "meridian_router_routing_table_age_seconds") == pytest.approx(45, abs=0.5)
        assert metric(text, "meridian_router_routing_table_version") == 1
    finally:
        await servers.stop()


async def test_with_a_metrics_port_metrics_move_to_the_admin_listener():
    servers = ServerGroup()
    behaviour = NodeBehaviour("us")
    admin_sock = reserve_port()
    try:
        node_url = await servers.start(node_app(behaviour))
        settings = router_settings(metrics_port=admin_sock.getsockname()[1], metrics_token="scrape-me",
                                   max_header_bytes=2048)
        app = create_app(settings, table_source=StaticTableSource(make_table([node("us", node_url)])))
        public = await servers.start(app)
        state = app.state.router
        metrics_app = create_metrics_app(settings, state.metrics, state.prober)
        admin = await servers.start(metrics_app, admin_sock, admin_config(settings, metrics_app))
        async with httpx.AsyncClient(base_url=public, headers={"authorization": f"Bearer {GLOBAL_KEY}"}) as http:
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            # Not even the cluster token gets tenant-labelled metrics on the public port.
            assert (await http.get("/metrics", headers=SCRAPE)).status_code == 404
        async with httpx.AsyncClient(base_url=admin) as http:
            assert (await http.get("/metrics")).status_code == 401
            r = await http.get("/metrics", headers={"authorization": "Bearer scrape-me"})
            assert r.status_code == 200
            assert metric(r.text, "meridian_router_tenant_requests_total", tenant="acme", model=MODEL,
                          zone="global", status="200") == 1
            # The admin listener has the listener limits too.
            big = await http.get("/metrics", headers={"x-pad": "a" * 4096})
            assert big.status_code == 431
    finally:
        await servers.stop()
        admin_sock.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_router_serve_runs_both_listeners_and_stops_on_sigterm(workers: int):
    """One process, or two workers (geo_router.workers) whose metrics listener, wherever a
    scrape lands, answers for both."""
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "MERIDIAN_ROUTER_PORT": str(port), "MERIDIAN_ROUTER_METRICS_PORT": str(metrics_port),
           "MERIDIAN_CLUSTER_TOKEN": "t", "MERIDIAN_ROUTER_CONTROL_PLANE_URL": f"http://127.0.0.1:{free_port()}",
           "MERIDIAN_ROUTER_PROBE_ENABLED": "false", "MERIDIAN_ROUTER_KV_EVENTS_ENABLED": "false",
           "MERIDIAN_ROUTER_WORKERS": str(workers)}
    code = "from geo_router.listener import serve; from meridian.settings.router import RouterSettings; serve(RouterSettings())"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        deadline = time.monotonic() + 30
        while not up():
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.1)
        if workers == 1:
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
            assert metric(text, "meridian_router_routing_table_age_seconds") == -1  # no table yet
        else:
            # Every scrape shows both workers, once both listen (the first may come sooner).
            while metric(text := httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text,
                         "meridian_router_workers_scraped") < 2:
                assert time.monotonic() < deadline, text
            for worker in ("0", "1"):
                assert metric(text, "meridian_router_routing_table_age_seconds", worker=worker) == -1
        public = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"authorization": "Bearer t"})
        assert public.status_code == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_imbalance_fallbacks_is_a_counter_of_the_routers_policy(fabric: Fabric):
    from candidate_kit import CTX, cand

    policy = fabric.app.state.router.policy
    hot_holder = [cand("a", in_flight=7, prefix_hit=0.95), cand("b", in_flight=1), cand("c", in_flight=1)]
    for _ in range(2):
        policy.order(hot_holder, CTX)
    text = await scrape(fabric)
    family = next(f for f in text_string_to_metric_families(text) if f.name == "meridian_router_imbalance_fallbacks")
    assert family.type == "counter"
    assert [(s.name, s.value) for s in family.samples if s.name.endswith("_total")] == [
        ("meridian_router_imbalance_fallbacks_total", 2)]
