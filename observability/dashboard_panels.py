"""What Meridian's four Grafana dashboards show: fabric, region, node and tenant.

build_dashboards.py turns these into Grafana's JSON model. Queries sum over every router
(each router counts only what it routed) and take the largest value of what every
control-plane replica reports alike (node counts, versions), so adding replicas changes
no panel.
"""

from __future__ import annotations

from dataclasses import dataclass

RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"  # or "stat"
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None
    bars: bool = False


@dataclass(frozen=True)
class Row:
    title: str


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str  # Grafana's label_values(selector, label)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    tags: tuple[str, ...]
    variables: tuple[Variable, ...]
    items: tuple[Panel | Row, ...]


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def quantiles(metric: str, by: str, selector: str = "", qs: tuple[float, ...] = (0.5, 0.99)) -> tuple[Query, ...]:
    """p50/p99 (by default) of histogram `metric`, per value of label `by`."""
    group = f"le, {by}" if by else "le"
    legend_by = f" {{{{{by}}}}}" if by else ""
    return tuple(
        q(f"histogram_quantile({x}, sum by ({group}) (rate({metric}_bucket{selector}[{RATE}])))",
          f"p{round(x * 100)}{legend_by}")
        for x in qs
    )


def ratio(bad: str, total: str, by: str = "", window: str = RATE, fn: str = "rate") -> str:
    """bad / total per `by` (everything when empty), 0 rather than no data where nothing
    was bad (a selector that matches nothing gives an empty vector, not 0)."""
    agg = f"sum by ({by})" if by else "sum"
    bad_s, total_s = f"{agg} ({fn}({bad}[{window}]))", f"{agg} ({fn}({total}[{window}]))"
    return f"({bad_s} or {total_s} * 0) / {total_s}"


REQUESTS = "meridian_router_requests_total"
ERRORS_5XX = 'meridian_router_requests_total{status=~"5.."}'
TENANT_REQUESTS = "meridian_router_tenant_requests_total"


FABRIC = Dashboard(
    uid="meridian-fabric", title="Meridian / Fabric",
    description="The whole fabric as its routers and control plane see it: traffic, errors, "
                "latency by region, each model's traffic and latency, failovers, ejections, scale-from-zero, "
                "routing tables and the control plane.",
    tags=("fabric",), variables=(),
    items=(
        Row("Traffic"),
        Panel("Availability (time range)", (q(
            "1 - " + ratio(ERRORS_5XX, REQUESTS, window="$__range", fn="increase")),),
            unit="percentunit", kind="stat", width=4, height=8,
            description="Share of inference requests not answered with a 5xx (SLO: 99.9%)."),
        Panel("Request rate by region", (q(f"sum by (region) (rate({REQUESTS}[{RATE}]))", "{{region}}"),),
              unit="reqps", width=10, description="Region '' is the router answering itself (no replica, refusals)."),
        Panel("Requests by status", (q(f"sum by (status) (rate({REQUESTS}[{RATE}]))", "{{status}}"),),
              unit="reqps", width=10),
        Panel("Error ratio (5xx)", (
            q(ratio(ERRORS_5XX, REQUESTS), "fabric"),
            q(ratio(ERRORS_5XX, REQUESTS, by="region"), "{{region}}"),
        ), unit="percentunit", min=0, width=12),
        Panel("Upstream failures by reason", (q(
            f"sum by (region, reason) (rate(meridian_router_upstream_failures_total[{RATE}]))",
            "{{region}} {{reason}}"),), unit="reqps", width=12,
            description="Node failures the routers saw (connect, timeout, 5xx, midstream); most are retried elsewhere."),
        Row("Latency"),
        Panel("Request duration by region", quantiles("meridian_router_request_duration_seconds", "region"),
              unit="s", width=12, description="Request received to last byte sent (SLO: 99% within 10 s)."),
        Panel("Time to first token by region", quantiles("meridian_router_time_to_first_byte_seconds", "region"),
              unit="s", width=12, description="Request received to the first byte (streams: the first token) from the node."),
        Panel("Router overhead", quantiles("meridian_router_overhead_seconds", "", qs=(0.5, 0.99, 0.999)),
              unit="s", width=8, description="Time in the router itself before the upstream request."),
        Panel("Tokens per second", (
            q(f"sum by (kind) (rate(meridian_router_tenant_tokens_total[{RATE}]))", "{{kind}}"),),
            unit="short", width=8, description="Prompt and completion tokens of all tenants' answered requests."),
        Panel("Affinity fallbacks", (q(f"sum(rate(meridian_router_imbalance_fallbacks_total[{RATE}]))", "fallbacks"),),
              unit="reqps", width=8,
              description="Requests sent least-load first because cache affinity would have made a hot spot."),
        Row("Models"),
        Panel("Requests by model", (q(f"sum by (model) (rate({TENANT_REQUESTS}[{RATE}]))", "{{model}}"),),
              unit="reqps", width=8, description="Inference requests of authenticated tenants, by the model asked for."),
        Panel("Error ratio by model (5xx)", (q(ratio(f'{TENANT_REQUESTS}{{status=~"5.."}}', TENANT_REQUESTS,
                                                     by="model"), "{{model}}"),),
              unit="percentunit", min=0, width=8),
        Panel("Tokens per second by model", (
            q(f"sum by (model, kind) (rate(meridian_router_tenant_tokens_total[{RATE}]))", "{{model}} {{kind}}"),),
            width=8),
        Panel("Time to first token by model", quantiles("vllm:time_to_first_token_seconds", "model_name"),
              unit="s", width=12, description="As the nodes' engines measure it, over every node serving the model."),
        Panel("Request latency by model", quantiles("vllm:e2e_request_latency_seconds", "model_name"),
              unit="s", width=12, description="Arrival at the node to the last token, over every node serving the model."),
        Row("Resilience"),
        Panel("Failovers", (q(f"sum by (from_region, to_region) (rate(meridian_router_failovers_total[{RATE}]))",
                              "{{from_region}} → {{to_region}}"),), unit="reqps", width=8),
        Panel("Node ejections", (q(f"sum by (region, node, reason) (increase(meridian_router_ejections_total[{RATE}]))",
                                   "{{node}} ({{reason}})"),), unit="short", bars=True, width=8),
        Panel("Rate-limited (429)", (q(f"sum by (limit) (rate(meridian_router_rate_limited_total[{RATE}]))",
                                       "{{limit}}"),), unit="reqps", width=8),
        Panel("Stream migrations", (
            q(f"sum by (reason, from_region, to_region) (rate(meridian_router_migrations_total[{RATE}]))",
              "{{reason}}: {{from_region}} → {{to_region}}"),
            q(f"sum by (why) (rate(meridian_router_migrations_refused_total[{RATE}]))", "refused: {{why}}")),
              unit="reqps", width=8,
              description="Streams resumed on another replica after their node failed mid-answer, and those "
                          "that could not be (they ended with an error event)."),
        Panel("Migration resume latency", quantiles("meridian_router_migration_resume_seconds", "", qs=(0.5, 0.99)),
              unit="s", width=8),
        Panel("Tokens re-prefilled by migrations", (
            q(f"sum(rate(meridian_router_migration_reprefill_tokens_total[{RATE}]))", "tokens/s"),), width=8),
        Panel("Prefill/decode: how requests were served", (
            q(f"sum by (region, how) (rate(meridian_router_pd_requests_total[{RATE}]))", "{{region}} {{how}}"),),
              unit="reqps", width=8,
              description="Decode attempts on disaggregated pools: disaggregated, prefill_failed (the decode worker "
                          "prefilled), no_prefill_pool, short_prompt (served whole by the decode worker)."),
        Panel("Prefill hops", (
            q(f"sum by (node, outcome) (rate(meridian_router_pd_prefills_total[{RATE}]))", "{{node}} {{outcome}}"),),
              unit="reqps", width=8, description="Prefill hops by prefill worker: ok, refused (the request's 4xx), failed."),
        Panel("Prefill hop latency", quantiles("meridian_router_pd_prefill_seconds", "", qs=(0.5, 0.99)),
              unit="s", width=8),
        Panel("Scale from zero: held requests", (
            q("sum by (model) (meridian_router_scale_from_zero_queued)", "{{model}}"),), width=8),
        Panel("Scale from zero: outcomes", (
            q(f"sum by (outcome) (rate(meridian_router_scale_up_requests_total[{RATE}]))", "scale-up {{outcome}}"),
            q(f"sum(rate(meridian_router_scale_from_zero_timeouts_total[{RATE}]))", "timed out"),
            q(f"sum(rate(meridian_router_scale_from_zero_rejected_total[{RATE}]))", "queue full"),
        ), unit="reqps", width=8),
        Panel("Scale from zero: wait", quantiles("meridian_router_scale_from_zero_wait_seconds", "", qs=(0.5, 0.9)),
              unit="s", width=8),
        Panel("Flow control: waiting", (
            q("sum by (zone, model, band) (meridian_router_flow_waiting)", "{{zone}} {{model}} band {{band}}"),),
            width=8, min=0,
            description="Requests held at the routers while their zone's replicas of the model are full, by priority "
                        "band: the backlog waits here, in fair order, rather than in each node's own queue."),
        Panel("Flow control: wait by band", quantiles("meridian_router_flow_wait_seconds", "band", qs=(0.5, 0.9)),
              unit="s", width=8,
              description="Time the requests that had to wait for room waited before going to a replica; "
                          "alert MeridianFlowWaitHigh when a band's p90 stays over its target."),
        Panel("Flow control: refused", (
            q(f"sum by (band, reason) (rate(meridian_router_flow_refused_total[{RATE}]))", "band {{band}} {{reason}}"),),
            unit="reqps", width=8,
            description="503s of flow control: queue_timeout (waited the request's TTL), queue_full, shed (a "
                        "sheddable request gave its place to a more urgent one)."),
        Panel("Ready replicas by zone", (
            q("max by (zone, model) (meridian_router_zone_ready_replicas)", "{{zone}} {{model}}"),), width=12, min=0,
            description="Ready replicas each zone's tenants may use, per deployment that keeps replicas; at 0 the "
                        "zone's requests are answered 503 no_replica_in_zone (alert MeridianZoneWithoutReplica)."),
        Panel("Answered by the router, by reason", (
            q(f'sum by (status, reason) (rate({REQUESTS}{{region=""}}[{RATE}]))', "{{status}} {{reason}}"),),
            unit="reqps", width=12,
            description="Requests the router answered itself (no replica in the zone, scaling from zero, refusals); "
                        "the 5xx among them count against the availability SLO."),
        Row("Routing tables and control plane"),
        Panel("Routing table version", (
            q("meridian_router_routing_table_version", "router {{instance}}"),
            q("max(meridian_cp_routing_table_version)", "control plane"),
        ), width=8, description="Each router's table against the control plane's latest."),
        Panel("Routing table age", (q("meridian_router_routing_table_age_seconds", "{{instance}}"),),
              unit="s", width=8, min=0,
              description="Seconds since each router's table was last confirmed current (alert over 120 s)."),
        Panel("Control-plane leader", (q("meridian_cp_leader", "{{instance}}"),), width=8, min=0, max=1,
              description="1 on the replica that leads (reconciler, reaper, autoscaler)."),
        Panel("Nodes by status", (q("max by (status) (meridian_cp_nodes)", "{{status}}"),), width=8),
        Panel("Reconciler passes", (q(f"sum by (result) (increase(meridian_cp_reconciler_passes_total[{RATE}]))",
                                      "{{result}}"),), bars=True, width=8),
        Panel("Reconciler steps", (q(f"sum by (action, outcome) (increase(meridian_cp_reconciler_steps_total[{RATE}]))",
                                     "{{action}} {{outcome}}"),), bars=True, width=8),
        Panel("Autoscaler decisions", (q(
            f'sum by (deployment, direction) (increase(meridian_cp_autoscaler_decisions_total{{direction!="hold"}}[{RATE}]))',
            "{{deployment}} {{direction}}"),), bars=True, width=12),
        Panel("Plan in force", (q("max by (plan_id) (meridian_cp_plan_in_force_info)", "{{plan_id}}"),),
              kind="stat", width=12, description="The placement plan the reconciler applies."),
    ),
)

_R = 'region="$region"'
REGION = Dashboard(
    uid="meridian-region", title="Meridian / Region",
    description="One region: its nodes, their load and KV-cache usage, traffic and time to first token.",
    tags=("region",),
    variables=(Variable("region", "Region", "label_values(meridian_cp_nodes, region)"),),
    items=(
        Row("Nodes"),
        Panel("Nodes by status", (q(f"max by (status) (meridian_cp_nodes{{{_R}}})", "{{status}}"),), width=8),
        Panel("Requests running per node", (q(f"sum by (node) (vllm:num_requests_running{{{_R}}})", "{{node}}"),),
              width=8),
        Panel("Requests waiting per node", (q(f"sum by (node) (vllm:num_requests_waiting{{{_R}}})", "{{node}}"),),
              width=8),
        Panel("KV-cache usage per node", (q(f"max by (node) (vllm:kv_cache_usage_perc{{{_R}}})", "{{node}}"),),
              unit="percentunit", min=0, max=1, width=12),
        Panel("Generated tokens per node", (
            q(f"sum by (node) (rate(vllm:generation_tokens_total{{{_R}}}[{RATE}]))", "{{node}}"),), width=12),
        Row("Traffic"),
        Panel("Request rate per node", (q(f"sum by (node) (rate(meridian_router_requests_total{{{_R}}}[{RATE}]))",
                                          "{{node}}"),), unit="reqps", width=8),
        Panel("Error ratio per node (5xx)", (q(ratio(
            f'meridian_router_requests_total{{{_R}, status=~"5.."}}', f"meridian_router_requests_total{{{_R}}}",
            by="node"), "{{node}}"),),
            unit="percentunit", min=0, width=8),
        Panel("Failovers out of and into the region", (
            q(f'sum by (to_region) (rate(meridian_router_failovers_total{{from_region="$region"}}[{RATE}]))',
              "out → {{to_region}}"),
            q(f'sum by (from_region) (rate(meridian_router_failovers_total{{to_region="$region"}}[{RATE}]))',
              "in ← {{from_region}}"),
        ), unit="reqps", width=8),
        Row("Latency"),
        Panel("Time to first token (router)", quantiles("meridian_router_time_to_first_byte_seconds", "node",
                                                        "{" + _R + "}"), unit="s", width=12),
        Panel("Time to first token (node)", quantiles("vllm:time_to_first_token_seconds", "node", "{" + _R + "}"),
              unit="s", width=12, description="As the engine measures it, without the network and the router."),
        Panel("Request duration", quantiles("meridian_router_request_duration_seconds", "", "{" + _R + "}"),
              unit="s", width=12),
        Panel("Ejections and upstream failures", (
            q(f"sum by (node, reason) (increase(meridian_router_ejections_total{{{_R}}}[{RATE}]))", "ejected {{node}} ({{reason}})"),
            q(f"sum by (node, reason) (increase(meridian_router_upstream_failures_total{{{_R}}}[{RATE}]))",
              "failed {{node}} ({{reason}})"),
        ), bars=True, width=12),
    ),
)

_N = 'node="$node"'
NODE = Dashboard(
    uid="meridian-node", title="Meridian / Node",
    description="One node: its engine's load, KV cache, tokens and latencies (vLLM's metric names on both "
                "engines; a vLLM node relays vLLM's own), its cold start, and how the routers see it.",
    tags=("node",),
    variables=(Variable("node", "Node", "label_values(vllm:num_requests_running, node)"),),
    items=(
        Row("Engine"),
        Panel("Requests", (
            q(f"sum(vllm:num_requests_running{{{_N}}})", "running"),
            q(f"sum(vllm:num_requests_waiting{{{_N}}})", "waiting"),
        ), width=8),
        Panel("KV-cache usage", (q(f"max(vllm:kv_cache_usage_perc{{{_N}}})", "used"),),
              unit="percentunit", min=0, max=1, width=8),
        Panel("Prefix-cache hit ratio", (q(
            f"sum(rate(vllm:prefix_cache_hits_total{{{_N}}}[{RATE}])) / sum(rate(vllm:prefix_cache_queries_total{{{_N}}}[{RATE}]))",
            "hits"),), unit="percentunit", min=0, max=1, width=8),
        Panel("Tokens per second", (
            q(f"sum(rate(vllm:prompt_tokens_total{{{_N}}}[{RATE}]))", "prompt"),
            q(f"sum(rate(vllm:generation_tokens_total{{{_N}}}[{RATE}]))", "generated"),
        ), width=8),
        Panel("Finished requests by reason", (
            q(f"sum by (finished_reason) (rate(vllm:request_success_total{{{_N}}}[{RATE}]))", "{{finished_reason}}"),),
            unit="reqps", width=8),
        Panel("Preemptions", (q(f"sum(rate(vllm:num_preemptions_total{{{_N}}}[{RATE}]))", "preemptions"),), width=8),
        Row("Latency (engine)"),
        Panel("Time to first token", quantiles("vllm:time_to_first_token_seconds", "", "{" + _N + "}"),
              unit="s", width=8),
        Panel("Inter-token latency", quantiles("vllm:inter_token_latency_seconds", "", "{" + _N + "}"),
              unit="s", width=8),
        Panel("End-to-end latency", quantiles("vllm:e2e_request_latency_seconds", "", "{" + _N + "}"),
              unit="s", width=8),
        Panel("vLLM: queue, prefill and decode time (p99)", (
            *quantiles("vllm:request_queue_time_seconds", "", "{" + _N + "}", qs=(0.99,)),
            *quantiles("vllm:request_prefill_time_seconds", "", "{" + _N + "}", qs=(0.99,)),
            *quantiles("vllm:request_decode_time_seconds", "", "{" + _N + "}", qs=(0.99,)),
        ), unit="s", width=24, description="vLLM nodes only (relayed from vLLM's own /metrics); empty on torch nodes."),
        Row("Start and routers' view"),
        Panel("Cold start", (q(f"max by (step) (meridian_node_cold_start_seconds{{{_N}}})", "{{step}}"),),
              unit="s", kind="stat", width=8,
              description="Seconds from agent start to weights cached, loaded and ready."),
        Panel("Weights fetched at start", (
            q(f"max by (source) (meridian_node_weights_fetched_bytes_total{{{_N}}})", "{{source}}"),),
            unit="bytes", kind="stat", width=8),
        Panel("Requests routed to the node", (
            q(f"sum by (status) (rate(meridian_router_requests_total{{{_N}}}[{RATE}]))", "{{status}}"),),
            unit="reqps", width=8),
        Panel("Time to first token (router)", quantiles("meridian_router_time_to_first_byte_seconds", "",
                                                        "{" + _N + "}"), unit="s", width=12),
        Panel("Ejections and upstream failures", (
            q(f"sum by (reason) (increase(meridian_router_ejections_total{{{_N}}}[{RATE}]))", "ejected ({{reason}})"),
            q(f"sum by (reason) (increase(meridian_router_upstream_failures_total{{{_N}}}[{RATE}]))",
              "failed ({{reason}})"),
        ), bars=True, width=12),
    ),
)

_T = 'tenant="$tenant"'
TENANT = Dashboard(
    uid="meridian-tenant", title="Meridian / Tenant",
    description="One tenant's requests, tokens and refusals, by model and residency zone.",
    tags=("tenant",),
    variables=(Variable("tenant", "Tenant", "label_values(meridian_router_tenant_requests_total, tenant)"),),
    items=(
        Row("Requests"),
        Panel("Requests (time range)", (
            q(f"sum(increase(meridian_router_tenant_requests_total{{{_T}}}[$__range]))", "requests"),),
            kind="stat", width=6),
        Panel("Tokens (time range)", (
            q(f"sum by (kind) (increase(meridian_router_tenant_tokens_total{{{_T}}}[$__range]))", "{{kind}}"),),
            kind="stat", width=6),
        Panel("Rate-limited (time range)", (
            q(f"sum(increase(meridian_router_rate_limited_total{{{_T}}}[$__range]))", "429"),),
            kind="stat", width=6),
        Panel("Error ratio (time range)", (q(ratio(
            f'meridian_router_tenant_requests_total{{{_T}, status=~"5.."}}', f"meridian_router_tenant_requests_total{{{_T}}}",
            window="$__range", fn="increase")),),
            unit="percentunit", kind="stat", width=6),
        Panel("Requests by model", (q(
            f"sum by (model) (rate(meridian_router_tenant_requests_total{{{_T}}}[{RATE}]))", "{{model}}"),),
            unit="reqps", width=12),
        Panel("Requests by status", (q(
            f"sum by (status) (rate(meridian_router_tenant_requests_total{{{_T}}}[{RATE}]))", "{{status}}"),),
            unit="reqps", width=12),
        Row("Tokens and limits"),
        Panel("Tokens per second by model", (q(
            f"sum by (model, kind) (rate(meridian_router_tenant_tokens_total{{{_T}}}[{RATE}]))",
            "{{model}} {{kind}}"),), width=12),
        Panel("Rate-limited (429) by limit", (q(
            f"sum by (limit) (rate(meridian_router_rate_limited_total{{{_T}}}[{RATE}]))", "{{limit}}"),),
            unit="reqps", width=12),
        Panel("Requests by residency zone", (q(
            f"sum by (zone) (rate(meridian_router_tenant_requests_total{{{_T}}}[{RATE}]))", "{{zone}}"),),
            unit="reqps", width=24),
        Row("Flow control"),
        Panel("Waiting for room", (q(
            f"sum by (zone, model, band) (meridian_router_flow_waiting{{{_T}}})", "{{zone}} {{model}} band {{band}}"),),
            width=8, min=0, description="The tenant's requests held at the routers while their replicas are full."),
        Panel("Wait for room", quantiles("meridian_router_flow_wait_seconds", "band", f"{{{_T}}}", qs=(0.5, 0.9)),
              unit="s", width=8),
        Panel("Refused by flow control", (q(
            f"sum by (reason) (rate(meridian_router_flow_refused_total{{{_T}}}[{RATE}]))", "{{reason}}"),),
            unit="reqps", width=8),
    ),
)

DASHBOARDS = (FABRIC, REGION, NODE, TENANT)
