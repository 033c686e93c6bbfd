"""The router's Prometheus metrics, in a registry owned by one app.

Every metric here may name tenants or nodes, so the page is served only to a scraper: on
the admin listener when `metrics_port` is set, else on the public port to a bearer of the
metrics or cluster token (geo_router.observability.admin_listener).

`meridian_router_imbalance_fallbacks_total` and `meridian_router_routing_table_age_seconds`
are read at scrape time from their owners (the affinity policy's running total, the table
source's last refresh on the app's clock), so the request path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..admission.flow_control import FlowGauges
from ..state.node_load import NodeLoad

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Label-set children cached by `child` at most (then the cache starts again).
_MAX_CHILDREN = 10_000
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _RunningTotal(Collector):
    """A counter whose total is kept by its owner (read at scrape time, never reset)."""

    def __init__(self, name: str, doc: str) -> None:
        self._name, self._doc = name, doc
        self.read: Callable[[], float] = lambda: 0.0

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._doc)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._doc, value=self.read())


class _ZoneReplicas(Collector):
    """Ready replicas per (zone, model), read from the routing table at scrape time."""

    NAME = "meridian_router_zone_ready_replicas"
    DOC = ("Ready replicas of each deployment that keeps replicas (min_replicas >= 1), per residency zone "
           "whose tenants may use it, in this router's routing table; 0: that zone's requests get 503 "
           "no_replica_in_zone.")

    def __init__(self) -> None:
        self.read: Callable[[], Mapping[tuple[str, str], int]] = dict

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.DOC, labels=("zone", "model"))

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=("zone", "model"))
        for (zone, model), count in sorted(self.read().items()):
            family.add_metric([zone, model], count)
        yield family


class _FlowQueues(Collector):
    """Flow control's pools, read at scrape time (geo_router.admission.flow_control.FlowGauges)."""

    def __init__(self) -> None:
        self.read: Callable[[], FlowGauges] = FlowGauges

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        pool = ("zone", "model")
        return (
            GaugeMetricFamily("meridian_router_flow_waiting", "Requests waiting at this router for room on their "
                              "zone's replicas (flow control), by zone, model, priority band and tenant.",
                              labels=(*pool, "band", "tenant")),
            GaugeMetricFamily("meridian_router_flow_running", "Requests flow control let go and that have not "
                              "finished, by zone and model.", labels=pool),
            GaugeMetricFamily("meridian_router_flow_slots", "Batch slots of the replicas a pool may use, as flow "
                              "control counts them (each node's max_num_seqs).", labels=pool),
            GaugeMetricFamily("meridian_router_flow_others", "Requests of other routers on a pool's replicas, as "
                              "the nodes' reports show them beyond this router's own.", labels=pool),
            GaugeMetricFamily("meridian_router_flow_reserve", "Slots of a pool kept for tenants below their fair "
                              "share: flow_reserve_share of them, or as many as the light tenants lately had "
                              "at once.", labels=pool),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        waiting, running, slots, others, reserve = self._families()
        gauges = self.read()
        for (zone, model, band, tenant), count in sorted(gauges.waiting.items()):
            waiting.add_metric([zone, model, str(band), tenant], count)
        for (zone, model), (let_go, n, other, kept) in sorted(gauges.pools.items()):
            running.add_metric([zone, model], let_go)
            slots.add_metric([zone, model], n)
            others.add_metric([zone, model], other)
            reserve.add_metric([zone, model], kept)
        yield from (waiting, running, slots, others, reserve)


class RouterMetrics:
    """Counters and histograms of one router app.

    `table_age` answers the seconds since the routing table was last confirmed current
    (-1 while there is none).
    """

    def __init__(self, table_version: Callable[[], float], table_age: Callable[[], float] = lambda: -1.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[str, ...], Any] = {}
        self.requests = self._counter(
            "meridian_router_requests", ("region", "node", "status", "reason"),
            "Inference requests answered, by serving region/node ('' when the router answered) and, "
            "for the router's own answers, the error code (reason; e.g. no_replica_in_zone, counted "
            "as a 5xx against the availability SLO like any other).")
        self.failovers = self._counter(
            "meridian_router_failovers", ("from_region", "to_region"),
            "Retries on another replica after a failure before the first byte.")
        self.upstream_failures = self._counter(
            "meridian_router_upstream_failures", ("region", "node", "reason"),
            "Node failures seen by this router (connect, timeout, 5xx, midstream...).")
        self.migrations = self._counter(
            "meridian_router_migrations", ("reason", "from_region", "to_region"),
            "Streams resumed on another replica after their node failed mid-answer, by why the "
            "node's piece ended (connection, server_error, stalled).")
        self.migrations_refused = self._counter(
            "meridian_router_migrations_refused", ("why",),
            "Broken streams not resumed (not_resumable, tool_format, limit, budget, no_replica, "
            "deadline); each ended with an error event.")
        self.reprefill_tokens = self._counter(
            "meridian_router_migration_reprefill_tokens", (),
            "Tokens (prompt plus generated) that migrations asked replicas to prefill again.")
        self.resume_latency = self._histogram(
            "meridian_router_migration_resume_seconds", (),
            "Time from a stream's break being seen to the first event of its continuation.", _LATENCY_BUCKETS)
        self.pd_requests = self._counter(
            "meridian_router_pd_requests", ("region", "how"),
            "Decode attempts on prefill/decode-disaggregated replicas, by how they were served: "
            "disaggregated, prefill_failed (the decode worker prefilled) or no_prefill_pool.")
        self.pd_prefills = self._counter(
            "meridian_router_pd_prefills", ("region", "node", "outcome"),
            "Prefill hops by prefill worker and outcome (ok, refused: the request's own 4xx, failed).")
        self.pd_prefill_latency = self._histogram(
            "meridian_router_pd_prefill_seconds", ("region",),
            "Time of a prefill hop that was answered, from sending it to the prefill worker's answer.",
            _LATENCY_BUCKETS)
        self.latency = self._histogram(
            "meridian_router_request_duration_seconds", ("region",),
            "Time from request received to last byte sent, by serving region.", _LATENCY_BUCKETS)
        self.ttft = self._histogram(
            "meridian_router_time_to_first_byte_seconds", ("region", "node"),
            "Time from request received to the first byte from the node (for streams: the first "
            "complete event, i.e. the first token), by serving region and node.", _LATENCY_BUCKETS)
        self.ejections = self._counter(
            "meridian_router_ejections", ("region", "node", "reason"),
            "Nodes this router ejected (passive outlier detection or failed active probes).")
        self.prompt_tokens = self._counter(
            "meridian_router_prompt_tokens", ("region", "node"),
            "Prompt tokens of the requests the router tokenized (affinity routing), by first-choice node.")
        self.predicted_cache_hits = self._counter(
            "meridian_router_predicted_cache_hit_tokens", ("region", "node"),
            "Prompt tokens the router predicted the first-choice node holds in its KV cache.")
        self.reported_cache_hits = self._gauge(
            "meridian_router_node_reported_cache_hit_tokens", ("node",),
            "Prompt tokens each node reports as prefix-cache hits (vllm:prefix_cache_hits, from probes).")
        self.reported_cache_queries = self._gauge(
            "meridian_router_node_reported_cache_query_tokens", ("node",),
            "Prompt tokens each node looked up in its prefix cache (vllm:prefix_cache_queries, from probes).")
        # A running total kept by the policy itself, read at scrape time (`count_fallbacks_of`).
        self._fallbacks = _RunningTotal(
            "meridian_router_imbalance_fallbacks",
            "Requests the affinity policy sent least-load first because affinity would create a hot spot.")
        self.registry.register(self._fallbacks)
        # The prober's own count (`count_probes_of`): with --workers, only the worker that leads
        # the probing counts any (geo_router.workers.host_probes).
        self._probes = _RunningTotal(
            "meridian_router_probes",
            "Active health probes this router process sent (with several workers, one worker probes for all).")
        self.registry.register(self._probes)
        self._zone_replicas = _ZoneReplicas()
        self.registry.register(self._zone_replicas)
        self.tenant_requests = self._counter(
            "meridian_router_tenant_requests", ("tenant", "model", "zone", "status"),
            "Inference requests of authenticated tenants, by model ('' when not one the table "
            "serves), residency zone and HTTP status.")
        self.tenant_tokens = self._counter(
            "meridian_router_tenant_tokens", ("tenant", "model", "zone", "kind"),
            "Tokens of the tenants' answered requests, kind prompt or completion: the answers' usage, "
            "else (a stream without a usage chunk) the prompt estimate and one token per event.")
        self.rate_limited = self._counter(
            "meridian_router_rate_limited", ("tenant", "limit"),
            "Requests refused with 429 by tenant rate limits, by limit (requests or tokens).")
        self.overhead = self._histogram(
            "meridian_router_overhead_seconds", (),
            "Time spent in the router itself before the upstream request (upstream waits excluded).", _OVERHEAD_BUCKETS)
        self.flow_wait = self._histogram(
            "meridian_router_flow_wait_seconds", ("zone", "band", "tenant"),
            "How long the requests that had to wait for room (flow control) waited before they went to "
            "a replica (one that found room at once is not counted).", _LATENCY_BUCKETS)
        self.flow_refused = self._counter(
            "meridian_router_flow_refused", ("zone", "band", "tenant", "reason"),
            "Requests flow control answered 503: queue_timeout (waited their TTL), queue_full (no "
            "place), shed (gave their place to a more urgent band).")
        self._flow_queues = _FlowQueues()
        self.registry.register(self._flow_queues)
        self.scale_queued = self._gauge(
            "meridian_router_scale_from_zero_queued", ("model",),
            "Requests held while their model scales up from zero replicas, or while a replica starts "
            "in a zone that has none ready.")
        self.scale_up_requests = self._counter(
            "meridian_router_scale_up_requests", ("model", "outcome"),
            "Scale-up requests sent to the control plane, by outcome (ok, not_found, error).")
        self.backlog_reports = self._counter(
            "meridian_router_flow_backlog_reports", ("outcome",),
            "Reports of flow control's backlog sent to the control plane, by outcome (ok, error).")
        self.scale_timeouts = self._counter(
            "meridian_router_scale_from_zero_timeouts", ("model",),
            "Held requests answered 503 because no replica became ready in time.")
        self.scale_rejected = self._counter(
            "meridian_router_scale_from_zero_rejected", ("model",),
            "Requests answered 503 at once because the model's scale-from-zero queue was full.")
        self.scale_wait = self._histogram(
            "meridian_router_scale_from_zero_wait_seconds", (),
            "How long held requests waited before a replica turned ready.", _LATENCY_BUCKETS)
        version = self._gauge(
            "meridian_router_routing_table_version", (),
            "Version of the routing table in use (-1 before one is loaded).")
        version.set_function(table_version)
        age = self._gauge(
            "meridian_router_routing_table_age_seconds", (),
            "Seconds since the routing table was last confirmed current by the control plane (or "
            "loaded from the snapshot); -1 before one is loaded, 0 for a static table.")
        age.set_function(table_age)

    def child(self, metric: str, *labels: str) -> Any:
        """`metric`'s child of `labels`, looked up once per label set: prometheus_client's
        labels() validates, joins and locks on every call, and a request updates several."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) > _MAX_CHILDREN:  # nodes and tenants come and go: not for ever
                self._children.clear()
            child = self._children[key] = getattr(self, metric).labels(*labels)
        return child

    def count_fallbacks_of(self, read: Callable[[], float]) -> None:
        """Export `read()` (a running total, e.g. the affinity policy's) as the fallbacks counter."""
        self._fallbacks.read = read

    def count_probes_of(self, read: Callable[[], float]) -> None:
        """Export `read()` (the prober's running total) as the probes counter."""
        self._probes.read = read

    def count_zone_replicas_of(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        """Export `read()` (ready replicas per (zone, model)) as meridian_router_zone_ready_replicas."""
        self._zone_replicas.read = read

    def count_flow_queues_of(self, read: Callable[[], FlowGauges]) -> None:
        """Export `read()` (flow control's waiting and running requests) as its gauges."""
        self._flow_queues.read = read

    def _counter(self, name: str, labels: Sequence[str], doc: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, labels: Sequence[str], doc: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, labels: Sequence[str], doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

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
