"""The router's own metrics: what the nodes report next to what the router predicted."""

from __future__ import annotations

from router_harness import metric

from geo_router.observability.metrics import RouterMetrics
from geo_router.state.node_load import NodeLoad


def test_reported_cache_counters_follow_the_probed_nodes():
    metrics = RouterMetrics(lambda: 1.0)
    metrics.set_reported_cache({
        "us-1": NodeLoad(prefix_cache_hits=300, prefix_cache_queries=1000),
        "us-2": NodeLoad(),  # a node that exports no prefix-cache counters
    })
    text = metrics.render().decode()
    assert metric(text, "meridian_router_node_reported_cache_hit_tokens", node="us-1") == 300
    assert metric(text, "meridian_router_node_reported_cache_query_tokens", node="us-1") == 1000
    assert "us-2" not in text
    # A node no longer probed (gone from the table, or stale) leaves the page.
    metrics.set_reported_cache({"us-2": NodeLoad(prefix_cache_hits=5, prefix_cache_queries=8)})
    text = metrics.render().decode()
    assert 'node="us-1"' not in text
    assert metric(text, "meridian_router_node_reported_cache_hit_tokens", node="us-2") == 5
