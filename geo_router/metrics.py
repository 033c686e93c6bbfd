"""The router's Prometheus metrics, in a registry owned by one app."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .node_load import NodeLoad

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    """Counters and histograms of one router app."""

    def __init__(self, table_version: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "meridian_router_requests",
            "Inference requests answered, by serving region/node ('' when the router answered).",
            ["region", "node", "status"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "meridian_router_failovers",
            "Retries on another replica after a failure before the first byte.",
            ["from_region", "to_region"],
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "meridian_router_upstream_failures",
            "Node failures seen by this router (connect, timeout, 5xx, midstream...).",
            ["region", "node", "reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "meridian_router_request_duration_seconds",
            "Time from request received to last byte sent, by serving region.",
            ["region"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "meridian_router_time_to_first_byte_seconds",
            "Time from request received to the first byte from the node (for streams: the first "
            "complete event, i.e. the first token), by serving region and node.",
            ["region", "node"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ejections = Counter(
            "meridian_router_ejections",
            "Nodes this router ejected (passive outlier detection or failed active probes).",
            ["region", "node", "reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "meridian_router_prompt_tokens",
            "Prompt tokens of the requests the router tokenized (affinity routing), by first-choice node.",
            ["region", "node"],
            registry=self.registry,
        )
        self.predicted_cache_hits = Counter(
            "meridian_router_predicted_cache_hit_tokens",
            "Prompt tokens the router predicted the first-choice node holds in its KV cache.",
            ["region", "node"],
            registry=self.registry,
        )
        self.reported_cache_hits = Gauge(
            "meridian_router_node_reported_cache_hit_tokens",
            "Prompt tokens each node reports as prefix-cache hits (vllm:prefix_cache_hits, from probes).",
            ["node"],
            registry=self.registry,
        )
        self.reported_cache_queries = Gauge(
            "meridian_router_node_reported_cache_query_tokens",
            "Prompt tokens each node looked up in its prefix cache (vllm:prefix_cache_queries, from probes).",
            ["node"],
            registry=self.registry,
        )
        # A running total kept by the policy itself, read at scrape time.
        self.imbalance_fallbacks = Gauge(
            "meridian_router_imbalance_fallbacks_total",
            "Requests the affinity policy sent least-load first because affinity would create a hot spot.",
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "meridian_router_rate_limited",
            "Requests refused with 429 by tenant rate limits, by limit (requests or tokens).",
            ["tenant", "limit"],
            registry=self.registry,
        )
        self.overhead = Histogram(
            "meridian_router_overhead_seconds",
            "Time spent in the router itself before the upstream request (upstream waits excluded).",
            buckets=_OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.scale_queued = Gauge(
            "meridian_router_scale_from_zero_queued",
            "Requests held while their model scales up from zero replicas.",
            ["model"],
            registry=self.registry,
        )
        self.scale_up_requests = Counter(
            "meridian_router_scale_up_requests",
            "Scale-up requests sent to the control plane, by outcome (ok, not_found, error).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.scale_timeouts = Counter(
            "meridian_router_scale_from_zero_timeouts",
            "Held requests answered 503 because no replica became ready in time.",
            ["model"],
            registry=self.registry,
        )
        self.scale_rejected = Counter(
            "meridian_router_scale_from_zero_rejected",
            "Requests answered 503 at once because the model's scale-from-zero queue was full.",
            ["model"],
            registry=self.registry,
        )
        self.scale_wait = Histogram(
            "meridian_router_scale_from_zero_wait_seconds",
            "How long held requests waited before a replica turned ready.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        version = Gauge(
            "meridian_router_routing_table_version",
            "Version of the routing table in use (-1 before one is loaded).",
            registry=self.registry,
        )
        version.set_function(table_version)

    def set_reported_cache(self, loads: Mapping[str, NodeLoad]) -> None:
        """The nodes' own prefix-cache counters as last probed (to compare with the predictions)."""
        self.reported_cache_hits.clear()
        self.reported_cache_queries.clear()
        for node_id, load in loads.items():
            if load.prefix_cache_hits is not None:
                self.reported_cache_hits.labels(node_id).set(load.prefix_cache_hits)
            if load.prefix_cache_queries is not None:
                self.reported_cache_queries.labels(node_id).set(load.prefix_cache_queries)

    def render(self) -> bytes:
        return generate_latest(self.registry)
