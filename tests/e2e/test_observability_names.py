"""The dashboards and alert rules read only metrics the components export.

A real fabric (control plane, one torch-engine node, router, as subprocesses) serves one
request, so that labelled series exist; then the router's, the node's and the control
plane's /metrics are scraped and every metric name in observability/grafana/*.json and
observability/prometheus/alerts.yml must be among the names they export (a histogram's
_bucket/_sum/_count, a counter's _total), recorded by a rule, or one of vLLM's own names
that a vLLM node relays (observability/vllm_metrics.txt, checked against real vLLM in
tests/integration/test_vllm_contract.py). A renamed metric fails here instead of leaving
an empty panel or an alert that cannot fire.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from e2e_fabric import e2e_spec, running
from promql_names import dashboard_queries, exported_names, rule_queries, unknown_names, vllm_relayed_names

from localfabric import DEMO_MODEL, LocalFabric

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

    router = exported_names(_scrape(info.router_url, info.cluster_token))
    node = exported_names(_scrape(info.nodes[REGION].url))
    control_plane = exported_names(_scrape(info.control_plane_url, info.cluster_token))
    # The request left labelled series behind, not just empty families.
    assert {"meridian_router_requests_total", "meridian_router_tenant_tokens_total",
            "meridian_router_request_duration_seconds_bucket"} <= router
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total"} <= node
    assert {"meridian_cp_leader", "meridian_cp_nodes", "meridian_cp_routing_table_version"} <= control_plane
    exported = router | node | control_plane | vllm_relayed_names()

    queries, recorded = referenced()
    assert len(queries) >= 80
    assert unknown_names(queries, exported, recorded) == {}

    # The check bites: a panel reading a name no component exports is reported.
    fake = {"fabric.json: Fake panel": ["sum(rate(meridian_router_no_such_metric_total[5m]))"]}
    assert unknown_names(queries | fake, exported, recorded) == {
        "meridian_router_no_such_metric_total": ["fabric.json: Fake panel"]}
    # vLLM's relayed names are not taken for the torch node's own.
    assert not vllm_relayed_names() & node
