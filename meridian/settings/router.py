"""The geo router's settings (`meridian router serve`, `MERIDIAN_ROUTER_*`, section `router:`)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from meridian.contracts import ROUTER_ID_PATTERN
from meridian.settings.base import CLUSTER_TOKEN_FIELD, ListenerSettings


class RouterSettings(ListenerSettings):
    """Settings of `meridian router serve`."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_ROUTER_", extra="ignore")
    config_section: ClassVar[str] = "router"

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # Processes serving the port as one router (geo_router.workers); 0 (default): one per CPU
    # this process may use. The listener limits (max_connections and the like) hold per worker.
    workers: int = Field(0, ge=0, le=256)
    control_plane_url: str = "http://127.0.0.1:8081"
    cluster_token: SecretStr = CLUSTER_TOKEN_FIELD
    # /metrics names nodes and tenants, so it answers only a bearer of this token or of the
    # cluster token (a Prometheus scrape config's `authorization: {credentials: ...}`).
    metrics_token: SecretStr | None = None
    # With a port, /metrics moves to a second listener on metrics_host:metrics_port (keep it
    # internal; it asks for metrics_token only when one is set) and the public port has none.
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    # OpenTelemetry traces (meridian.tracing), off unless set: the OTLP/HTTP collector
    # (e.g. http://collector:4318), and per residency zone a collector of its own for the
    # spans of that zone's tenants (a JSON object such as {"eu": "https://otel.eu:4318"}).
    otlp_endpoint: str | None = None
    otlp_zone_endpoints: dict[str, str] = Field(default_factory=dict)
    # Header an edge proxy you trust sets to the client's location ("lat,lon" or a
    # region name such as "aws:us-east-1"). Strip it at the edge from client requests.
    client_location_header: str = "x-meridian-client-location"
    # Where clients are assumed to be when no trusted header says otherwise.
    default_client_location: str = "aws:us-east-1"
    # Last routing table is kept here so a restarted router can serve while the
    # control plane is down.
    snapshot_path: Path | None = None
    # The snapshot is rewritten at most this often (the newest table is always written in the
    # end, and at stop): at 10,000 nodes it is 1.7 MB, and tables change every few seconds.
    snapshot_interval_s: float = Field(5.0, ge=0)
    table_poll_timeout_s: float = Field(20.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    # Upper bound on a whole upstream request (generation can be long).
    request_timeout_s: float = Field(300.0, gt=0)
    # Longest silence allowed between two chunks of a streamed answer.
    read_timeout_s: float = Field(60.0, gt=0)
    max_attempts: int = Field(3, ge=1, le=10)
    # One INFO line per routed request under the logger `meridian.access` (geo_router.observability.access_log).
    access_log: bool = True
    # With a path, every attempt sent to a node is journalled there as a JSON line keyed by
    # the request's idempotency key (meridian.request_journal; chaos drills read it).
    request_journal_path: Path | None = None
    # A node that failed is skipped for this long (doubling on repeated failures).
    ejection_base_s: float = Field(5.0, gt=0)
    ejection_max_s: float = Field(60.0, gt=0)
    max_request_bytes: int = Field(1_000_000, gt=0)
    # Responses API WebSocket mode (GET /v1/responses upgraded): a connection with no event
    # for ws_idle_timeout_s, or open for ws_max_connection_s (OpenAI's limit: 60 min), is
    # closed between turns (code 1001: the client reconnects); at most ws_max_lanes
    # conversations (`stream_id`) per connection. A message is at most max_request_bytes.
    # Every turn, a warm-up (`generate: false`) too, is a request: the key, max_request_bytes,
    # the tenant's rate limits and accounting apply to it (geo_router.ingress.websocket.endpoint).
    ws_idle_timeout_s: float = Field(300.0, gt=0)
    ws_max_connection_s: float = Field(3600.0, gt=0)
    ws_max_lanes: int = Field(16, ge=1, le=1024)
    # An idle connection's key is checked again this often (each turn checks it too): a
    # revoked or expired key's socket is closed 1008 within this time of the routing table
    # dropping it. One dict lookup per connection per interval, so the bound can be short.
    ws_key_recheck_s: float = Field(30.0, gt=0)
    # What the router may remember for a connection, in bytes of JSON: a lane's conversation
    # (the turn as sent plus the output it continues from) and all lanes together. A turn
    # that would go past either is refused (`conversation_too_large`) and nothing is kept.
    # A lane holds what its next turn re-sends, which max_request_bytes bounds too, so the
    # lane cap bites where an operator raises that: 8 MB is ~2M tokens of text, past any
    # context window served, or a long conversation with a few images. 32 MB is four such
    # lanes and more than 16 lanes at the default max_request_bytes.
    ws_max_lane_bytes: int = Field(8_000_000, gt=0)
    ws_max_socket_bytes: int = Field(32_000_000, gt=0)
    # gRPC (KServe Open Inference Protocol v2 with Triton's streaming, geo_router.ingress.kserve) on
    # this port when set (0: any free port); on grpc_host, else host. At most
    # grpc_max_concurrent_rpcs calls at once (more: RESOURCE_EXHAUSTED), that many streams per
    # connection, and grpc_max_requests_per_stream requests of one ModelStreamInfer at once.
    grpc_port: int | None = Field(None, ge=0, le=65535)
    grpc_host: str | None = None
    grpc_max_concurrent_rpcs: int = Field(1024, ge=1)
    grpc_max_streams_per_connection: int = Field(100, ge=1)
    grpc_max_requests_per_stream: int = Field(64, ge=1)
    # HTTP/2 on the public HTTP port next to HTTP/1.1 (h2c by prior knowledge; h2 by ALPN
    # with TLS), at most this many concurrent streams per connection (meridian.http2).
    http2_enabled: bool = True
    http2_max_streams_per_connection: int = Field(100, ge=1)
    # TLS for the public listeners (HTTP and gRPC) when both are set: PEM files.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Name of the RoutingPolicy (geo_router.selection.policies registry) that orders replicas:
    # affinity (default), nearest, least-load or round-robin.
    routing_policy: str = "affinity"
    # At most this many replicas of a model are candidates for one request (geo_router.selection.candidates):
    # the nearest regions' first (3/4), a uniform sample of the rest after them. Routing work per
    # request grows with it, not with the fleet: each candidate is built, annotated and scored,
    # ~3x what building it costs (python -m bench.candidates). 32 keeps 24 near replicas
    # (several regions' worth, past max_attempts) and 8 further ones to spill and fail over
    # to; sampled choices balance load long before that (power of d choices: d=2 does).
    max_candidates: int = Field(32, ge=2)
    # affinity policy: weights of KV-prefix overlap, LoRA residency, load and KV usage in a
    # replica's score; a region whose RTT plus queueing exceeds the latency objective spills
    # to the next one; the imbalance gate falls back to least-load when the best-scoring
    # replica has more than imbalance_abs_threshold pending requests beyond the least loaded
    # one and more than imbalance_ratio times its load.
    affinity_prefix_weight: float = Field(1.0, ge=0)
    affinity_lora_weight: float = Field(0.5, ge=0)
    affinity_load_weight: float = Field(0.5, ge=0)
    affinity_kv_usage_weight: float = Field(0.2, ge=0)
    latency_objective_ms: float = Field(1000.0, gt=0)
    imbalance_abs_threshold: int = Field(4, ge=0)
    imbalance_ratio: float = Field(1.5, ge=1)
    # Pending requests that count as "fully loaded" in the affinity score (at least).
    affinity_load_scale: int = Field(2, ge=1)
    # Weight of a replica's excess share of recent requests, decaying with this half-life.
    affinity_balance_weight: float = Field(0.5, ge=0)
    affinity_balance_half_life_s: float = Field(60.0, gt=0)
    # Time to first byte assumed for a node until the router has measured it.
    default_service_ms: float = Field(200.0, gt=0)
    # Size of the one pooled HTTP client the router uses to reach every node.
    max_upstream_connections: int = Field(512, gt=0)
    # With Redis, routers share node ejections (a node one router saw fail is skipped by
    # all); without it each router keeps its own view. In-flight counts stay per router.
    redis_url: str | None = None
    # How often a router reads the other routers' ejections from Redis.
    fleet_sync_interval_s: float = Field(0.5, gt=0)
    # Timeout of every Redis call (connect and read); Redis is never on the request path.
    redis_timeout_s: float = Field(1.0, gt=0)
    # Keys are `<prefix>ejected:<node_id>` plus the index `<prefix>ejected`.
    fleet_key_prefix: str = "meridian:router:"
    # Prefix keys (geo_router.selection.prefix) and the approximate prefix index (geo_router.state.prefix_history).
    # Tokenizers let the router template and tokenise prompts as nodes do, so its block hashes
    # equal those in the nodes' KV events: a JSON object model -> checkpoint directory (with
    # tokenizer.json and tokenizer_config.json) and/or a root with one directory per model.
    tokenizer_dirs: dict[str, Path] = Field(default_factory=dict)
    tokenizer_root: Path | None = None
    # Only this many leading prompt tokens are tokenised and hashed: it is CPU on the event loop.
    prefix_max_tokens: int = Field(8192, ge=16)
    # Routing-history keys hash the prompt's text in chunks of this many bytes (no tokenizer).
    prefix_text_chunk_bytes: int = Field(128, ge=16)
    # A node is believed to hold a prompt prefix this long after a request with it went there;
    # at most max_keys chunk keys are remembered (least recently routed dropped first).
    prefix_history_ttl_s: float = Field(300.0, gt=0)
    prefix_history_max_keys: int = Field(100_000, ge=1)
    # With Redis, routers share routing history through the stream `<prefix>prefix-history`,
    # trimmed to this many entries and to entries younger than prefix_history_ttl_s.
    prefix_history_stream_maxlen: int = Field(10_000, ge=100)
    # Tenant rate limits (geo_router.admission.ratelimit): token buckets hold this many seconds of a
    # tenant's per-minute limits (60: bursts of up to one minute's worth).
    rate_limit_burst_s: float = Field(60.0, gt=0)
    # Completion tokens charged up front for a request that sets neither max_tokens nor
    # max_completion_tokens; settled against the answer's `usage` when it comes.
    rate_limit_default_completion_tokens: int = Field(256, ge=0)
    # Flow control (geo_router.admission.flow_control): once a zone's replicas of a model are
    # full, requests wait at the router, ordered by priority band and fair share, instead of
    # in each node's first-come queue. "Full" is the replicas' batch slots (each node's
    # max_num_seqs as it registered it; flow_default_slots for one that did not say) less a
    # reserve of flow_reserve_share of them (0: none), kept for tenants below their fair share
    # of the pool: a light tenant's request starts at once beside a flood instead of waiting for
    # a flooding tenant's request to finish. When the light tenants have lately had more
    # requests at once (the most over the last one to two flow_reserve_window_s), the reserve
    # is that many, up to half the slots. Nothing waits while there is room.
    flow_control: bool = True
    flow_default_slots: int = Field(32, ge=1)
    flow_reserve_share: float = Field(0.0625, ge=0, lt=1)
    flow_reserve_window_s: float = Field(10.0, gt=0)
    # How long a request may wait for room (x-meridian-queue-ttl asks for less or more, up to
    # the max); past it: 503 queue_timeout with Retry-After.
    flow_queue_ttl_s: float = Field(30.0, gt=0)
    flow_queue_max_ttl_s: float = Field(300.0, gt=0)
    # What one (zone, model) queue holds at most; an arrival beyond it sheds the newest waiting
    # requests of sheddable (negative-priority) bands below its own, or is refused (503 queue_full).
    flow_queue_max_entries: int = Field(10_000, ge=1)
    flow_queue_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    # While requests wait, the router tells the control plane what it holds this often (and
    # once more when nothing waits any more), for the autoscaler and the console; 0: never.
    # Its name there is router_id, by default "<hostname>:<port>:<pid>" (one per worker).
    flow_backlog_report_s: float = Field(2.0, ge=0)
    # With Redis, each router publishes its requests running per pool this often and reads the
    # other routers' (geo_router.admission.flow_peers): what flow control counts as theirs.
    flow_peers_sync_interval_s: float = Field(0.1, gt=0)
    router_id: str | None = Field(None, pattern=ROUTER_ID_PATTERN)
    # Client location (geo_router.selection.locate): a MaxMind DB (GeoIP2/GeoLite2 City .mmdb) that
    # locates clients the edge header does not; unset, they are at default_client_location.
    geoip_database: Path | None = None
    # Peers in these networks are proxies whose X-Forwarded-For is believed (a JSON list of
    # CIDRs such as ["10.0.0.0/8"], checked when the router starts); nobody else's is.
    trusted_proxies: list[str] = Field(default_factory=list)
    # Where this router runs ("lat,lon" or a region name): measured round trips from here to
    # regions refine the great-circle RTT estimates.
    router_location: str | None = None
    # Node health, Envoy-style (geo_router.state.probe, geo_router.state.health, geo_router.forwarding.outlier).
    # Active probes: every READY node's GET /metrics every probe_interval_s (jittered), which
    # also reads its load; probe_unhealthy_threshold failures in a row eject the node, and
    # probe_healthy_threshold successes in a row while it is ejected bring it back early.
    probe_enabled: bool = True
    probe_interval_s: float = Field(1.0, gt=0)
    probe_timeout_s: float = Field(1.0, gt=0)
    probe_unhealthy_threshold: int = Field(2, ge=1)
    probe_healthy_threshold: int = Field(2, ge=1)
    probe_concurrency: int = Field(32, ge=1)
    # The probes one router sends per second at most, whatever the fleet's size: a node is
    # probed every max(probe_interval_s, READY nodes / probe_max_per_s) seconds (jittered),
    # so a fleet of up to probe_max_per_s x probe_interval_s nodes is probed as configured
    # and a larger one less often. A probe costs the router ~1.7-2 ms of CPU (httpx; measured
    # by bench/probes.py on a busy 2-core box), so 100/s is ~20% of a core at most.
    probe_max_per_s: float = Field(100.0, gt=0)
    # Passive outlier detection: a node that cannot be reached is ejected at once; 5xx,
    # timeouts and broken streams eject it after this many in a row (Envoy's consecutive_5xx).
    consecutive_failures_to_eject: int = Field(5, ge=1)
    # Ejection never takes more than this share of the routing table's READY nodes out (at
    # least one node may always be ejected); beyond it a failure is counted, not enforced.
    max_ejected_percent: float = Field(50.0, ge=0, le=100)
    # Circuit breaker: a node with this many requests in flight from this router takes no more.
    max_pending_per_node: int = Field(256, ge=1)
    # Retry budget: failover attempts in flight may be at most this percentage of the requests
    # in flight, but never fewer than min_retry_concurrency.
    retry_budget_percent: float = Field(20.0, ge=0, le=100)
    min_retry_concurrency: int = Field(3, ge=0)
    # Stream migration (geo_router.forwarding.migration): a chat or completions stream whose node fails
    # after the first byte resumes on another replica of the tenant's zone from the prompt's
    # and the generated token ids. A stream is failed when its connection breaks, its node
    # sends an error event, or no event comes for inter_token_timeout_s (a frozen node).
    migration_enabled: bool = True
    inter_token_timeout_s: float = Field(10.0, gt=0)
    migration_max_per_request: int = Field(3, ge=0, le=20)
    # Migrations in flight may be at most this share of the streams in flight (never fewer
    # than min_migration_concurrency), and the tokens they re-prefill come from a bucket of
    # migration_budget_burst_tokens refilled at migration_budget_tokens_per_s; a migration
    # over the budget waits its turn up to migration_queue_timeout_s, then is refused.
    # inter_token_timeout_s also bounds a continuation's first token (its prefill). A whole
    # region's streams breaking at once is what migration is for, so by default they may all
    # move at once and the token bucket is what bounds the prefills; a lower share spreads
    # a herd's re-prefills over time (each wave waits for the one before).
    migration_budget_percent: float = Field(100.0, ge=0, le=100)
    min_migration_concurrency: int = Field(8, ge=0)
    migration_queue_timeout_s: float = Field(5.0, ge=0)
    migration_budget_tokens_per_s: float = Field(200_000.0, ge=0)
    migration_budget_burst_tokens: int = Field(2_000_000, ge=0)
    # KV-prefix index from the nodes' KV cache events (geo_router.state.kv_index, kv_subscriber):
    # the router subscribes to every node that advertises a kv_events endpoint.
    kv_events_enabled: bool = True
    # ZMQ topic (prefix) subscribed to; the nodes' kv_events_topic.
    kv_events_topic: str = "kv-events"
    # Safety cap on one node's indexed blocks (its oldest are forgotten beyond it); keep it
    # above the largest node's KV cache size in blocks, offloaded tiers included.
    kv_index_max_blocks_per_node: int = Field(262_144, ge=1)
    # A replay (missed batches) that sends nothing for this long is given up: the node's
    # entries are cleared instead.
    kv_events_replay_timeout_s: float = Field(2.0, gt=0)
    # On (re)connecting to a node, replay what its publisher still buffers, so a router
    # that starts late knows the blocks cached before it subscribed.
    kv_events_replay_on_connect: bool = True
    # Index only the KV caches of nodes in regions within this estimated round trip of
    # `router_location` (geo_router.state.kv_scope); unset, every node's. A router's clients are near
    # it and its candidates are drawn nearest region first, so a far region's cache seldom
    # decides a placement, while each indexed node costs a ZMQ stream and ~75 bytes a cached
    # block (10,000 nodes x 512 blocks: 374 MiB). Nodes outside are matched by the routing
    # history instead, as nodes without KV events are. Needs `router_location`.
    kv_events_max_rtt_ms: float | None = Field(None, gt=0)
    # Scale-from-zero: a request for a deployed model with no ready replica waits here
    # (at most this many per model) while the control plane is asked to scale it up.
    scale_from_zero_queue_size: int = Field(64, ge=1)
    # No tenant may hold more than this share of a model's queue, so that one tenant's burst
    # cannot lock the others out of a cold model.
    scale_from_zero_tenant_share: float = Field(0.5, gt=0, le=1)
    # A held request that sees no ready replica within this long gets 503 + Retry-After.
    scale_from_zero_timeout_s: float = Field(120.0, gt=0)
    # While requests wait, the scale-up request is repeated this often (it is idempotent).
    scale_from_zero_reask_s: float = Field(15.0, gt=0)
    # Retry-After (seconds) sent with a scale-from-zero 503 (queue full or deadline passed).
    scale_from_zero_retry_after_s: int = Field(5, ge=1)
    # Timeout of one scale-up call to the control plane.
    scale_up_timeout_s: float = Field(5.0, gt=0)
    # A zone that lost its replicas (issue 32): a request for a deployment that keeps replicas
    # (min_replicas >= 1) with none ready in its tenant's zone waits at most this long for one
    # starting there, then gets 503 no_replica_in_zone; with none starting it gets that 503 at
    # once. The client sees no byte while it waits: keep this under its timeout.
    replica_start_wait_s: float = Field(10.0, ge=0)
    # Retry-After (seconds) of those 503s.
    no_replica_retry_after_s: int = Field(5, ge=1)
    # Prefill/decode disaggregation: with a region's prefill and decode pools both up, a
    # request is prefilled on one (within pd_prefill_timeout_s, on at most pd_prefill_attempts
    # workers) and decoded on the other; with either pool empty, or this off, co-located.
    pd_enabled: bool = True
    # Prompts estimated shorter than this (characters / 4) are served whole by the decode
    # worker: their prefill costs it less than the hop and the KV pull would (Dynamo's
    # max_local_prefill_length, llm-d's P/D threshold). 0 disaggregates every prompt.
    pd_min_prompt_tokens: int = Field(256, ge=0)
    pd_prefill_timeout_s: float = Field(30.0, gt=0)
    pd_prefill_attempts: int = Field(2, ge=1, le=10)

    @model_validator(mode="after")
    def _kv_scope_has_a_centre(self) -> RouterSettings:
        if self.kv_events_max_rtt_ms is not None and not self.router_location:
            raise ValueError("kv_events_max_rtt_ms needs router_location (the point the round trips are measured from)")
        return self
