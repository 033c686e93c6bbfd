"""The tokenizer that finds the metric names in the dashboards' and rules' queries: it must
see every name a query selects and take no function, keyword or label for one, else the
names check (tests/e2e/test_observability_names.py) would miss a renamed metric or fail
on a correct query."""

from __future__ import annotations

import pytest
from promql_names import metric_names, unknown_names


@pytest.mark.parametrize(("expr", "names"), [
    ("up", {"up"}),
    ('sum(rate(meridian_router_requests_total{status=~"5..", region="$region"}[$__rate_interval]))',
     {"meridian_router_requests_total"}),
    ("histogram_quantile(0.99, sum by (le, region) (rate(meridian_router_request_duration_seconds_bucket[5m])))",
     {"meridian_router_request_duration_seconds_bucket"}),
    ("sum(rate(a_total[5m])) by (region) / ignoring(status) group_left(node) sum without (node) (b_total)",
     {"a_total", "b_total"}),
    ('vllm:kv_cache_usage_perc{node="$node"} * on (node) group_left (region) meridian_node_info',
     {"vllm:kv_cache_usage_perc", "meridian_node_info"}),
    ("max(meridian_cp_leader) or vector(0) < 1 and bool x offset 1h", {"meridian_cp_leader", "x"}),
    ("rate(x[5m:30s]) > 2e-3 unless y{le=\"10.0\"} + 0x1F", {"x", "y"}),
    ('count by (region) (meridian_cp_nodes{status="ready", region=~"aws:.*"}) > inf', {"meridian_cp_nodes"}),
    ("label_values(meridian_router_requests_total{region!=\"\"}, region)", {"meridian_router_requests_total"}),
    ("label_values(vllm:num_requests_running, node)", {"vllm:num_requests_running"}),
    ("query_result(topk(5, sum by (tenant) (rate(meridian_router_tenant_requests_total[1h]))))",
     {"meridian_router_tenant_requests_total"}),
    ("meridian:router_error_ratio:rate5m > (14.4 * 0.001)", {"meridian:router_error_ratio:rate5m"}),
    ("time() - process_start_time_seconds", {"process_start_time_seconds"}),
])
def test_the_names_a_query_selects(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_names_neither_exported_nor_recorded_are_reported_with_where_they_are_read() -> None:
    exprs = {
        "fabric.json: Requests": ["sum(rate(meridian_router_requests_total[5m]))"],
        "alerts.yml: Burn": ["meridian:router_error_ratio:rate5m > 0.01", "rate(meridian_typo_total[5m])"],
    }
    exported = {"meridian_router_requests_total"}
    assert unknown_names(exprs, exported, {"meridian:router_error_ratio:rate5m"}) == {
        "meridian_typo_total": ["alerts.yml: Burn"]}
    assert unknown_names(exprs, exported) == {
        "meridian:router_error_ratio:rate5m": ["alerts.yml: Burn"], "meridian_typo_total": ["alerts.yml: Burn"]}
