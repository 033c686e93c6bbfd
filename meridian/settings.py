"""All of Meridian's settings, in one place (pydantic-settings, env prefix `MERIDIAN_`).

Each process reads its own class: `MERIDIAN_CP_*` for the control plane,
`MERIDIAN_ROUTER_*` for the geo router, `MERIDIAN_NODE_*` for a data-plane node,
`MERIDIAN_PROVIDER_*` for how the control plane reaches the clouds.
`MERIDIAN_CLUSTER_TOKEN` is shared: nodes and routers present it to the control plane.
`MERIDIAN_LOG_*` is every process's log format and level (meridian.logs).

A YAML config file (`meridian --config FILE`, or `MERIDIAN_CONFIG=FILE`) holds the same
settings, one section per class (`control_plane:`, `router:`, `node:`, `weights:`,
`provider:`, `cli:`, `log:`) whose keys are the field names. Precedence, highest first:
CLI flags > environment variables > the config file > the defaults here. The file's
sections and keys are checked by meridian.config_file before any process starts.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import ClassVar

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from meridian.contracts import KVConnector, NodeRole, ProviderName

_CLUSTER_TOKEN = Field(
    validation_alias=AliasChoices("MERIDIAN_CLUSTER_TOKEN", "cluster_token"),
    description="Shared secret nodes and routers present to the control plane.",
)


# Environment variable naming the config file when no --config flag was given.
CONFIG_ENV = "MERIDIAN_CONFIG"
_config_path: Path | None = None


def use_config_file(path: Path | None) -> None:
    """Make every settings class built from now on read `path` (None: only MERIDIAN_CONFIG)."""
    global _config_path
    _config_path = path


def config_file_path() -> Path | None:
    """The config file in force: the one given to use_config_file, else MERIDIAN_CONFIG's."""
    if _config_path is not None:
        return _config_path
    named = os.environ.get(CONFIG_ENV)
    return Path(named) if named else None


class FileSettings(BaseSettings):
    """Settings that also read their section of the config file, below the environment."""

    # Top-level key of this class's section in the config file ("" for none).
    config_section: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: flags (init), then the environment, then the file.
        sources = (init_settings, env_settings, dotenv_settings, file_secret_settings)
        path = config_file_path()
        if not cls.config_section or path is None or not _has_section(path, cls.config_section):
            return sources
        return (*sources, YamlConfigSettingsSource(settings_cls, yaml_file=path,
                                                   yaml_config_section=cls.config_section))


def _has_section(path: Path, section: str) -> bool:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False  # meridian.config_file reports it; here the file is simply not read
    return isinstance(data, dict) and isinstance(data.get(section), dict)


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


class LogSettings(FileSettings):
    """Every process's logs (`MERIDIAN_LOG_*`, section `log:`): one line per record, as text
    or as one JSON object (ts, level, logger, msg and the record's extra fields)."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_LOG_", extra="ignore")
    config_section: ClassVar[str] = "log"

    format: LogFormat = LogFormat.TEXT
    level: str = Field("INFO", pattern=r"(?i)^(DEBUG|INFO|WARNING|ERROR|CRITICAL)$")


class ListenerSettings(FileSettings):
    """Limits of a process's HTTP listener (meridian.http_server), under its own prefix:
    `MERIDIAN_ROUTER_MAX_HEADER_BYTES`, `MERIDIAN_NODE_HEADER_TIMEOUT_S`, `MERIDIAN_CP_…`."""

    # A request head (request line + headers) over this is answered 431.
    max_header_bytes: int = Field(32 * 1024, ge=1024)
    # The whole head must arrive within this of its first byte, the body within
    # body_timeout_s of the head's end: 408 and the connection closed otherwise (an HTTP/2
    # stream is answered 408 and reset; its connection stays).
    header_timeout_s: float = Field(15.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)
    # Open connections beyond this are answered 503 with Retry-After and closed at once.
    max_connections: int = Field(4096, ge=1)
    # The same, per client address (0: no such limit). Leave it off behind a load balancer
    # or proxy, whose few addresses carry every client's connections.
    max_connections_per_client: int = Field(0, ge=0)
    # HTTP/1.1 pipelining: with this many requests of one connection waiting behind the one
    # being answered, nothing more of it is parsed or read until one is answered.
    max_pipelined_requests: int = Field(8, ge=1, le=1024)
    # HTTP/2 (the router's public listener, meridian.http2): a connection that sends more
    # control frames than this within a second (SETTINGS, PING, PRIORITY, RST_STREAM,
    # WINDOW_UPDATE beyond two per DATA frame sent, unknown types, empty DATA) is sent GOAWAY
    # ENHANCE_YOUR_CALM and closed. A real client sends a few SETTINGS and PINGs per
    # connection and at most one RST_STREAM per stream it cancels (100 streams at once), so
    # 1,000 leaves it tenfold room; the flood it stops sent 86,000 a second.
    http2_max_control_frames_per_s: int = Field(1000, ge=10)


class ControlPlaneSettings(ListenerSettings):
    """Settings of `meridian control-plane serve`."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_CP_", extra="ignore")
    config_section: ClassVar[str] = "control_plane"

    host: str = "127.0.0.1"
    port: int = Field(8081, ge=0, le=65535)
    database_url: str = "sqlite:///./meridian-state.db"
    cluster_token: SecretStr = _CLUSTER_TOKEN
    # GET /metrics answers a bearer of this token, of the cluster token, or of an API key
    # with the admin, operator or read-only scope (a Prometheus scrape config's credentials).
    metrics_token: SecretStr | None = None
    # Hash of this key is ensured at start-up as an admin-scoped key, so a fresh
    # deployment can create its first tenants. Unset in steady state.
    bootstrap_admin_key: SecretStr | None = None
    heartbeat_interval_s: float = Field(2.0, gt=0)
    # A node whose last heartbeat is older than this is marked lost and leaves the table.
    node_ttl_s: float = Field(10.0, gt=0)
    # The heartbeat rate the control plane is sized to take (all replicas together; None: no
    # limit). A larger fleet is told a longer interval, live nodes / this, and its TTL grows
    # in proportion (control_plane.heartbeat_pacing). A heartbeat costs ~2 ms of control-plane
    # CPU (bench/heartbeats, 2-core box): 250 a second is half a core, and 10,000 nodes are
    # told 40 s (TTL 200 s).
    max_heartbeats_per_s: float | None = Field(250.0, gt=0)
    # Registrations in flight at once per process (control_plane.registration_gate); the rest
    # are answered 429 with a Retry-After at once. A registration is ~6-8 ms of CPU and waits
    # for its version bump besides: on an idle 2-core box 8 at a time register 158 a second and
    # 32 at a time 112 (contention). In the fleet simulator at 3,000 nodes joining at 100 a
    # second, 8 admitted ~21 a second and reaped no live node; 16 and 64 admitted faster and
    # starved the heartbeats (33 and 9 live nodes reaped). None: no limit.
    max_concurrent_registrations: int | None = Field(8, ge=1)
    # The database pool of the API's threads (Postgres; SQLite has one writer anyway). Sized
    # to what runs at once, so that a burst does not open and close a connection per request
    # past the pool (a Postgres backend's start is milliseconds of CPU).
    db_pool_size: int = Field(20, ge=1)
    db_max_overflow: int = Field(10, ge=0)
    # Lost nodes are forgotten after this long.
    lost_node_retention_s: float = Field(3600.0, gt=0)
    reaper_interval_s: float = Field(1.0, gt=0)
    # After the control plane starts, or its database comes back, no node is expired for this
    # long: nobody could record heartbeats meanwhile. Default: the TTL plus the longest
    # heartbeat retry backoff of a node (meridian.contracts.HEARTBEAT_RETRY_MAX_S).
    reaper_grace_s: float | None = Field(None, ge=0)
    # Static stability (control_plane.reaper): the control plane's own lag never expires a
    # healthy fleet. A reaper pass that starts more than reaper_interval_s + this after the
    # previous one means the control plane itself stalled (paused, starved of CPU, blocked)
    # and heard no heartbeat meanwhile: the grace above restarts. Default: the heartbeat interval.
    reaper_stall_s: float | None = Field(None, gt=0)
    # While nodes are silent past the TTL, expire none ("hold") if the newest heartbeat of any
    # node is older than this (nobody's heartbeat is being recorded: the control plane is
    # behind). Default: two heartbeat intervals.
    reaper_heartbeats_behind_s: float | None = Field(None, gt=0)
    # Hold too while more than this share of the fleet is silent past the TTL at once (1: never).
    reaper_max_silent_share: float = Field(0.5, gt=0, le=1)
    # The holds apply to fleets of at least this many nodes: a lone node's death is reaped.
    reaper_hold_min_nodes: int = Field(2, ge=1)
    # A pass expires at most this share of a region's nodes (lost ones included; at least
    # one), longest silent first: a region that goes silent is taken out over 1/share passes.
    reaper_region_share_per_pass: float = Field(0.2, gt=0, le=1)
    max_long_poll_s: float = Field(30.0, gt=0)
    # Routing tables this process built and keeps to answer "changes since version V" with a
    # delta (control_plane.table_stream): at most this many versions and about this many bytes
    # (the serialized size of each, an upper bound on what they hold). A router further behind
    # gets the full table.
    routing_history_versions: int = Field(64, ge=1)
    routing_history_bytes: int = Field(64 * 1024 * 1024, ge=0)
    # Routing-table builds are at least this far apart: a storm of changes (a fleet
    # registering at once) costs one build per interval, each covering every change committed
    # before it, rather than one per version (at 10,000 nodes a build is ~0.2 s of CPU, and
    # builds back to back starved the heartbeats). A change reaches routers at most this later.
    routing_build_min_interval_s: float = Field(0.25, ge=0)
    # And at least the last build's CPU time times (1 / share - 1) apart: table builds take at
    # most this share of a core however large the fleet (control_plane.table_stream).
    routing_build_max_cpu_share: float = Field(0.25, gt=0, le=1)
    max_request_bytes: int = Field(1_000_000, gt=0)
    onprem_inventory: Path | None = None
    # Reported by GET /health, so a client can tell this control plane from another that later
    # answers on the same address: the local fabric sets one and records it in its fabric.json.
    instance_id: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    # Chaos drill reports the web console lists (`meridian chaos run --out DIR` writes
    # DIR/<drill>/report.json and timeline.png); None: the console shows none.
    drill_reports_dir: Path | None = None
    # --- fleet loops: leader election, reconciler, autoscaler ---------------------------
    # One control plane leads the reconciler and autoscaler: on Postgres the holder of an
    # advisory lock (checked this often); on SQLite (one control plane only) a lease row.
    reconciler_enabled: bool = True
    autoscaler_enabled: bool = True
    leader_check_interval_s: float = Field(1.0, gt=0)
    leader_lease_s: float = Field(10.0, gt=0)
    # Shown as the leader's name; defaults to "<hostname>:<pid>".
    replica_id: str | None = Field(None, max_length=120)
    reconcile_interval_s: float = Field(2.0, gt=0)
    # A failed reconcile step is retried after base * 2**(n-1) seconds (±20% jitter), capped.
    reconcile_backoff_base_s: float = Field(1.0, gt=0)
    reconcile_backoff_max_s: float = Field(300.0, gt=0)
    # A node being removed is drained (routers stop sending) until its heartbeat shows no
    # running or waiting request, or this long at most.
    reconcile_drain_timeout_s: float = Field(120.0, ge=0)
    # Upper bound on one provider driver call.
    driver_timeout_s: float = Field(60.0, gt=0)
    autoscale_interval_s: float = Field(2.0, gt=0)
    # A decision that keeps the replica count is recorded at most this often per deployment.
    autoscale_hold_record_s: float = Field(60.0, gt=0)


class ProviderSettings(FileSettings):
    """How the control plane reaches each provider's API (its node-group drivers and quotas)."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_PROVIDER_", extra="ignore")
    config_section: ClassVar[str] = "provider"

    # Providers whose drivers the reconciler uses; the on-prem one needs no credentials. Any
    # registered provider (providers.provider.PROVIDERS), checked where the drivers are built.
    enabled: list[ProviderName] = Field(default_factory=lambda: ["onprem"])
    # AWS: credentials come from boto3's usual chain (env, profile, instance role).
    # An endpoint URL points every AWS client at an S3/EC2-compatible stand-in (moto in tests).
    aws_endpoint_url: str | None = None
    # Names of the Auto Scaling groups and launch templates iac creates: "<prefix>-<...>".
    aws_name_prefix: str = "meridian"
    # GCP: the project that holds the managed instance groups; credentials from Application
    # Default Credentials unless an endpoint (a local stand-in) is set, which needs none.
    gcp_project: str | None = None
    gcp_endpoint_url: str | None = None
    gcp_name_prefix: str = "meridian"
    # Upper bound on one call to a provider's API (each SDK call; waits poll within it).
    call_timeout_s: float = Field(30.0, gt=0)
    # How long a driver waits for a cloud operation to finish (a resize: until its instances
    # exist, not until they boot). Below the control plane's driver_timeout_s (60 s), so a
    # slow resize ends as the driver's own clear error; the reconciler retries it.
    operation_timeout_s: float = Field(45.0, gt=0)


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
    cluster_token: SecretStr = _CLUSTER_TOKEN
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


class WeightSettings(FileSettings):
    """The weight store and node cache, shared by nodes and `meridian model push/pull`
    (`MERIDIAN_WEIGHTS_*`). Cloud credentials come from the clouds' usual variables."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_WEIGHTS_", extra="ignore")
    config_section: ClassVar[str] = "weights"

    # Content-addressed node cache; models are published here by atomic rename.
    cache_dir: Path = Path(".meridian/weights")
    # Disk the cache may take; least recently used models no deployment on the node
    # uses are evicted to stay under it. None: only the free disk space limits it.
    cache_budget_bytes: int | None = Field(None, gt=0)
    # Digest granularity of manifests that `push` writes (fetches verify each chunk).
    manifest_chunk_bytes: int = Field(16 * 1024 * 1024, ge=4096)
    # Bytes per ranged GET (rounded to whole manifest chunks) and GETs in flight per
    # node across all files. S3 guidance: 8-16 MB ranges, one connection per 50-90 MB/s.
    range_bytes: int = Field(16 * 1024 * 1024, ge=4096)
    concurrency: int = Field(16, ge=1, le=256)
    # Per-range retries: exponential backoff from retry_base_s to retry_max_s, full jitter.
    max_attempts: int = Field(5, ge=1, le=20)
    retry_base_s: float = Field(0.2, gt=0)
    retry_max_s: float = Field(5.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest silence while reading one range.
    read_timeout_s: float = Field(60.0, gt=0)
    # Ask the control plane for same-region peers before going to the origin.
    peer_fetch: bool = True
    # peer:// sources present the cluster token to other nodes' weight endpoints.
    cluster_token: SecretStr | None = Field(
        None, validation_alias=AliasChoices("MERIDIAN_CLUSTER_TOKEN", "cluster_token")
    )
    # Largest range a node serves a peer in one response (bounds its memory per request).
    peer_max_range_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    # S3 API: endpoint for non-AWS stores (MinIO, moto, R2); the bucket's region for
    # SigV4 and for residency checks. Keys given here (or AWS_ACCESS_KEY_ID /
    # AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN) are used as they are; without them,
    # botocore's chain (profiles, web identity, container credentials, EC2 instance
    # role), refreshed before expiry; with nothing found, requests go unsigned.
    s3_endpoint_url: str | None = None
    s3_region: str = Field("us-east-1", validation_alias=AliasChoices("MERIDIAN_WEIGHTS_S3_REGION", "AWS_REGION", "s3_region"))
    s3_access_key_id: str | None = Field(None, validation_alias=AliasChoices("AWS_ACCESS_KEY_ID", "s3_access_key_id"))
    s3_secret_access_key: SecretStr | None = Field(None, validation_alias=AliasChoices("AWS_SECRET_ACCESS_KEY", "s3_secret_access_key"))
    s3_session_token: SecretStr | None = Field(None, validation_alias=AliasChoices("AWS_SESSION_TOKEN", "s3_session_token"))
    # GCS JSON API: endpoint for emulators (unauthenticated); a static bearer token, else
    # Application Default Credentials (google-auth), refreshed before expiry.
    gcs_endpoint_url: str = "https://storage.googleapis.com"
    gcs_token: SecretStr | None = Field(None, validation_alias=AliasChoices("MERIDIAN_WEIGHTS_GCS_TOKEN", "GOOGLE_OAUTH_ACCESS_TOKEN", "gcs_token"))
    # Objects above this size are pushed to S3/GCS in parts of multipart_part_bytes.
    multipart_threshold_bytes: int = Field(64 * 1024 * 1024, ge=5 * 1024 * 1024)
    multipart_part_bytes: int = Field(64 * 1024 * 1024, ge=5 * 1024 * 1024)


class NodeSettings(ListenerSettings):
    """Settings of `meridian node run`."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_NODE_", extra="ignore")
    config_section: ClassVar[str] = "node"

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    node_id: str = ""
    region: str = ""
    # URL routers use to reach this node; defaults to http://host:port.
    advertise_url: str | None = None
    control_plane_url: str | None = "http://127.0.0.1:8081"
    cluster_token: SecretStr | None = Field(
        None, validation_alias=AliasChoices("MERIDIAN_CLUSTER_TOKEN", "cluster_token")
    )
    model_dir: Path | None = None
    # Or where to fetch the model from (s3://, gs://, https://, file://, peer://): it is
    # pulled into the weight cache (MERIDIAN_WEIGHTS_*) and served from there.
    model_uri: str | None = None
    # Name the model is served under; defaults to the checkpoint directory's (or the
    # URI's last path segment's) name.
    model_name: str | None = None
    engine: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int = Field(2048, gt=0)
    max_tokens_limit: int = Field(1024, gt=0)
    max_request_bytes: int = Field(1_000_000, gt=0)
    max_waiting_requests: int = Field(256, ge=1)
    # Sequences decoded concurrently (vLLM's max_num_seqs); the rest wait in the queue.
    max_num_seqs: int = Field(32, ge=1)
    # Tokens (prefill chunks + decodes) one engine step may process, vLLM's
    # --max-num-batched-tokens; with chunked prefill, long prompts are split to fit.
    max_num_batched_tokens: int = Field(512, ge=16)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Tokens per KV cache block, and the memory the paged KV cache may take.
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_memory_bytes: int = Field(256 * 1024 * 1024, ge=64 * 1024)
    # LoRA: adapters by name (name=path, comma separated in the environment) and/or a
    # directory whose sub-directories are adapters; at most max_loras resident at once.
    lora_modules: dict[str, Path] = Field(default_factory=dict)
    lora_dir: Path | None = None
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(64, ge=1)
    # KV cache events (vLLM's wire format) on a ZMQ PUB socket; off when unset.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    # The endpoints routers connect to, advertised when the node registers; by default
    # derived from the ones above, a wildcard host replaced by the advertised URL's host.
    kv_events_advertise: str | None = None
    kv_events_replay_advertise: str | None = None
    # Prefill/decode disaggregation (meridian.kv_transfer): the node's role, its KV connector
    # (None: the engine's own, NIXL for vLLM and Meridian's HTTP one for torch), the port of
    # the connector's side channel (NIXL's; 0 picks a free one; the torch engine serves KV on
    # the node's own port), and how long a prefill worker holds a request's KV blocks for
    # the decode worker that has not pulled them (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    role: NodeRole = NodeRole.BOTH
    kv_connector: KVConnector | None = None
    kv_side_channel_port: int = Field(0, ge=0, le=65535)
    kv_lease_s: float = Field(60.0, gt=0, le=86_400)
    drain_timeout_s: float = Field(30.0, ge=0)
    control_plane_timeout_s: float = Field(5.0, gt=0)
    # OpenTelemetry traces, as the router's: the default collector, and one per residency
    # zone for the spans of requests the router marked with that zone (vLLM's own spans go
    # to otlp_endpoint, through --otlp-traces-endpoint).
    otlp_endpoint: str | None = None
    otlp_zone_endpoints: dict[str, str] = Field(default_factory=dict)
    # With a path, every request the node stops working on is journalled there as a JSON
    # line keyed by its x-request-id (meridian.request_journal; chaos drills read it).
    request_journal_path: Path | None = None
    # The weight store and cache (MERIDIAN_WEIGHTS_*), used when model_uri is set.
    weights: WeightSettings = Field(default_factory=WeightSettings)

    # --- vLLM adapter (engine = "vllm"): `vllm serve` run as a supervised child -------
    # What starts vLLM: "auto" (vLLM's OpenAI server module under the Python that has vLLM:
    # the project's .venv-vllm from `make vllm`, else a `vllm` script's, else this one), or
    # a command line ("vllm", then "serve MODEL" follows) or a JSON list of arguments.
    vllm_executable: str | list[str] = "auto"
    # DeploymentSpec (data_plane.engine.vllm.spec; JSON or YAML). Without one, it is derived
    # from this node's settings (model_name, max_model_len, lora_modules...).
    deployment_spec_file: Path | None = None
    # GPUs vLLM may use; unset: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`. 0 (or none
    # found): vLLM's CPU build, its KV cache in host memory (cpu_kvcache_space_gib).
    vllm_gpu_count: int | None = Field(None, ge=0)
    # Local directory of the speculative-decoding draft weights, when the spec names one.
    vllm_draft_model_dir: Path | None = None
    # Loopback ports of vLLM's HTTP server and KV event sockets; 0 picks a free one.
    vllm_port: int = Field(0, ge=0, le=65535)
    vllm_kv_events_port: int = Field(0, ge=0, le=65535)
    vllm_kv_events_replay_port: int = Field(0, ge=0, le=65535)
    # Loading a large checkpoint (and compiling CUDA graphs) takes minutes.
    vllm_startup_timeout_s: float = Field(1800.0, gt=0)
    # Interval of the health probe and the /metrics scrape.
    vllm_probe_interval_s: float = Field(1.0, gt=0)
    # Longest silence allowed in a streamed answer from vLLM (queueing included).
    vllm_read_timeout_s: float = Field(600.0, gt=0)
    # More than vllm_max_restarts exits within vllm_restart_window_s: give up (node fails).
    vllm_max_restarts: int = Field(5, ge=0)
    vllm_restart_window_s: float = Field(600.0, gt=0)
    # Restart delay doubles from vllm_restart_backoff_s up to the max, with +/-20% jitter.
    vllm_restart_backoff_s: float = Field(2.0, gt=0)
    vllm_restart_backoff_max_s: float = Field(60.0, gt=0)
    # After SIGTERM, vLLM gets this long to exit before its process group is SIGKILLed.
    vllm_stop_grace_s: float = Field(30.0, ge=0)


class CLISettings(FileSettings):
    """Settings of the operator CLI (`meridian status`, `meridian keys …`)."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_", extra="ignore")
    config_section: ClassVar[str] = "cli"

    control_plane_url: str = "http://127.0.0.1:8081"
    api_key: SecretStr | None = None
    timeout_s: float = Field(10.0, gt=0)
    # Where `meridian demo` keeps the models it fetches and converts (SmolLM2); None:
    # $XDG_CACHE_HOME/meridian/models, else ~/.cache/meridian/models.
    model_cache_dir: Path | None = None
