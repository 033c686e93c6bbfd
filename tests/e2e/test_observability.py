"""The dashboards and alert rules against a running fabric: they read only metrics the
components export, and with Prometheus scraping it, the dashboards show it.

A real fabric (control plane, one torch-engine node, router, as subprocesses) serves one
request, so that labelled series exist; then the router's, the node's and the control
plane's /metrics are scraped and every metric name in observability/grafana/*.json and
observability/prometheus/alerts.yml must be among the names they export (a histogram's
_bucket/_sum/_count, a counter's _total), recorded by a rule, or one of vLLM's own names
that a vLLM node relays (observability/vllm_metrics.txt, checked against real vLLM in
tests/integration/test_vllm_contract.py). A renamed metric fails here instead of leaving
an empty panel or an alert that cannot fire.

Then a real Prometheus (Debian's) scrapes the fabric as observability/prometheus/prometheus.yml
does, node targets labelled from the control plane's node list, and every dashboard query
runs on it with the variables set from their own queries: the panels about traffic,
latency, load, routing tables, the control plane and the tenant show data, and every rule
evaluates without error. No alert fires on the healthy fabric; when its node is killed,
the node-ejection, fast availability-burn and lost-node alerts do. The router and the control
plane are scraped with the fabric's metrics token. `up`, which the router-down alert reads,
is Prometheus' own series.

Also: one request's access lines at the router and at its node join on its request_id.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from e2e_fabric import e2e_spec, running
from prometheus_server import ScrapeJob, prometheus, query, wait_until_scraped
from promql_names import (
    SCRAPE_SERIES,
    dashboard_queries,
    exported_names,
    rule_queries,
    unknown_names,
    vllm_relayed_names,
)

from localfabric import DEMO_MODEL, FabricInfo, LocalFabric

pytestmark = pytest.mark.e2e

OBSERVABILITY = Path(__file__).parents[2] / "observability"
REGION = "aws:us-east-1"


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFabric]:
    yield from running(e2e_spec(tmp_path_factory.mktemp("fabric"), regions=(REGION,),
                                default_client_location=REGION))


def _scrape(url: str, token: str | None = None) -> str:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.text


def referenced() -> tuple[dict[str, list[str]], set[str]]:
    """The queries of every dashboard and rule, and the names the rules record."""
    queries: dict[str, list[str]] = {}
    for path in sorted((OBSERVABILITY / "grafana").glob("*.json")):
        queries |= dashboard_queries(json.loads(path.read_text()), path.name)
    rules, recorded = rule_queries(yaml.safe_load((OBSERVABILITY / "prometheus" / "alerts.yml").read_text()),
                                   "alerts.yml")
    return queries | rules, recorded


def test_dashboards_and_rules_read_only_exported_metrics(fabric: LocalFabric) -> None:
    info = fabric.info
    assert info is not None
    r = httpx.post(f"{info.router_url}/v1/chat/completions", timeout=60,
                   headers={"authorization": f"Bearer {info.keys['global']}"},
                   json={"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text

    router = exported_names(_scrape(info.router_url, info.metrics_token))
    node = exported_names(_scrape(info.nodes[REGION].url))
    control_plane = exported_names(_scrape(info.control_plane_url, info.metrics_token))
    # The request left labelled series behind, not just empty families.
    assert {"meridian_router_requests_total", "meridian_router_tenant_tokens_total",
            "meridian_router_request_duration_seconds_bucket"} <= router
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total"} <= node
    assert {"meridian_cp_leader", "meridian_cp_nodes", "meridian_cp_routing_table_version"} <= control_plane
    exported = router | node | control_plane | vllm_relayed_names() | SCRAPE_SERIES

    queries, recorded = referenced()
    assert len(queries) >= 80
    assert unknown_names(queries, exported, recorded) == {}

    # The check bites: a panel reading a name no component exports is reported.
    fake = {"fabric.json: Fake panel": ["sum(rate(meridian_router_no_such_metric_total[5m]))"]}
    assert unknown_names(queries | fake, exported, recorded) == {
        "meridian_router_no_such_metric_total": ["fabric.json: Fake panel"]}
    # vLLM's relayed names are not taken for the torch node's own.
    assert not vllm_relayed_names() & node


def test_the_router_and_node_access_lines_join_on_request_id(fabric: LocalFabric) -> None:
    # One request through the router and its node (separate processes, each logging as
    # `meridian router serve` and `meridian node run` do): both lines name it.
    info = fabric.info
    assert info is not None
    r = httpx.post(f"{info.router_url}/v1/chat/completions", timeout=60,
                   headers={"authorization": f"Bearer {info.keys['global']}", "x-request-id": "join-me-1"},
                   json={"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-request-id"] == "join-me-1"
    node = info.nodes[REGION]

    def lines(log: Path) -> list[str]:
        return [line for line in log.read_text(errors="replace").splitlines() if "request_id=join-me-1" in line]

    deadline = time.monotonic() + 10
    while not (lines(fabric.spec.work_dir / "logs" / "router.log") and lines(node.log)):
        assert time.monotonic() < deadline, "an access line without the request id"
        time.sleep(0.2)
    [router_line], [node_line] = lines(fabric.spec.work_dir / "logs" / "router.log"), lines(node.log)
    assert "meridian.access" in router_line and f"node={node.node_id}" in router_line
    assert "uvicorn.access" in node_line and '"POST /v1/chat/completions HTTP/1.1" 200' in node_line


# Panels that must show data once a request went through (the others plot failures,
# failovers, scale-from-zero, vLLM-only families or a plan in force: none here).
SHOWING = {
    "fabric": {"Availability (time range)", "Request rate by region", "Requests by status", "Error ratio (5xx)",
               "Request duration by region", "Time to first token by region", "Router overhead",
               "Tokens per second", "Affinity fallbacks", "Routing table version", "Routing table age",
               "Control-plane leader", "Nodes by status", "Reconciler passes",
               "Requests by model", "Error ratio by model (5xx)", "Tokens per second by model",
               "Time to first token by model", "Request latency by model"},
    "region": {"Nodes by status", "Requests running per node", "Requests waiting per node", "KV-cache usage per node",
               "Generated tokens per node", "Request rate per node", "Error ratio per node (5xx)",
               "Time to first token (router)", "Time to first token (node)", "Request duration"},
    "node": {"Requests", "KV-cache usage", "Prefix-cache hit ratio", "Tokens per second", "Finished requests by reason",
             "Preemptions", "Time to first token", "Inter-token latency", "End-to-end latency", "Cold start",
             "Weights fetched at start", "Requests routed to the node", "Time to first token (router)"},
    "tenant": {"Requests (time range)", "Tokens (time range)", "Error ratio (time range)", "Requests by model",
               "Requests by status", "Tokens per second by model", "Requests by residency zone"},
}


def _host_port(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def _node_targets(info: FabricInfo) -> list[ScrapeJob]:
    """Node scrape jobs labelled from GET /v1/nodes, as prometheus.yml's file_sd recipe does."""
    r = httpx.get(f"{info.control_plane_url}/v1/nodes", timeout=10,
                  headers={"authorization": f"Bearer {info.admin_key}"})
    assert r.status_code == 200, r.text
    return [ScrapeJob(f"node-{i}", [_host_port(n["url"])], {"region": n["region"], "node": n["node_id"]})
            for i, n in enumerate(r.json())]


def _variable_values(url: str, definition: str) -> set[str]:
    """What Grafana's `label_values(selector, label)` lists, asked of Prometheus."""
    m = re.fullmatch(r"label_values\((?P<selector>.+), (?P<label>\w+)\)", definition)
    assert m is not None, definition
    r = httpx.get(f"{url}/api/v1/series", params={"match[]": m["selector"]}, timeout=10)
    assert r.status_code == 200, r.text
    return {series[m["label"]] for series in r.json()["data"] if m["label"] in series}


def _panels_with_data(url: str, model: dict[str, Any], values: dict[str, str]) -> set[str]:
    showing = set()
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "20s").replace("$__range", "10m")
            for name, value in values.items():
                expr = expr.replace(f"${name}", value)
            if query(url, expr):
                showing.add(panel["title"])
    return showing


def _chat(info: FabricInfo) -> httpx.Response:
    return httpx.post(f"{info.router_url}/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer {info.keys['global']}"},
                      json={"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


@pytest.fixture(scope="module")
def scraped(fabric: LocalFabric, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus scraping the fabric, once it has seen requests go through; its URL."""
    info = fabric.info
    assert info is not None
    jobs = [ScrapeJob("meridian-router", [_host_port(info.router_url)], {}, info.metrics_token),
            ScrapeJob("meridian-control-plane", [_host_port(info.control_plane_url)], {}, info.metrics_token),
            *_node_targets(info)]
    with prometheus(jobs, tmp_path_factory.mktemp("prometheus")) as url:
        wait_until_scraped(url)
        # Requests spread over scrapes until the rates see them (and a few more after).
        deadline, seen = time.monotonic() + 60, 0
        while seen < 3:
            r = _chat(info)
            assert r.status_code == 200, r.text
            time.sleep(1.2)
            if query(url, "sum(rate(meridian_router_requests_total[20s])) > 0"):
                seen += 1
            assert time.monotonic() < deadline, "Prometheus never saw the requests"
        yield url


def test_the_dashboards_show_the_fabric_prometheus_scrapes(fabric: LocalFabric, scraped: str) -> None:
    info, url = fabric.info, scraped
    assert info is not None
    dashboards = {p.stem: json.loads(p.read_text()) for p in (OBSERVABILITY / "grafana").glob("*.json")}
    values: dict[str, str] = {}
    for model in dashboards.values():
        for variable in model["templating"]["list"]:
            if variable["type"] == "query":
                listed = _variable_values(url, variable["definition"])
                assert len(listed) == 1, f"${variable['name']}: {listed}"
                values[variable["name"]] = listed.pop()
    assert values["region"] == REGION and values["tenant"] == "demo-global"
    assert values["node"] == info.nodes[REGION].node_id

    for name, model in sorted(dashboards.items()):
        missing = SHOWING[name] - _panels_with_data(url, model, values)
        assert missing == set(), f"{name}.json panels without data: {sorted(missing)}"

    rules = httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    evaluated = [rule for group in rules for rule in group["rules"]]
    shipped = yaml.safe_load((OBSERVABILITY / "prometheus" / "alerts.yml").read_text())["groups"]
    assert len(evaluated) == sum(len(group["rules"]) for group in shipped)
    assert all(rule["health"] == "ok" for rule in evaluated), evaluated


def _firing(url: str) -> set[tuple[str, str | None]]:
    """(alert name, node label) of the alerts firing now."""
    alerts = httpx.get(f"{url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return {(a["labels"]["alertname"], a["labels"].get("node")) for a in alerts if a["state"] == "firing"}


def test_a_killed_node_fires_the_ejection_availability_and_lost_node_alerts(fabric: LocalFabric,
                                                                           scraped: str) -> None:
    # Last in the module: the fabric is left without its node.
    info = fabric.info
    assert info is not None
    assert _firing(scraped) == set(), "alerts firing on a healthy fabric"
    fabric.kill_node(REGION)
    node_id = info.nodes[REGION].node_id
    deadline, failed = time.monotonic() + 60, 0
    while True:
        if _chat(info).status_code >= 500:
            failed += 1
        firing = _firing(scraped)
        if {("MeridianNodeEjected", node_id), ("MeridianAvailabilityBudgetBurnFast", None),
                ("MeridianNodesLost", None)} <= firing:
            break
        assert time.monotonic() < deadline, f"alerts firing after {failed} failed requests: {sorted(firing)}"
        time.sleep(1)
    assert failed >= 1
