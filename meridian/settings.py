"""All of Meridian's settings, in one place (pydantic-settings, env prefix `MERIDIAN_`).

Each process reads its own class: `MERIDIAN_CP_*` for the control plane,
`MERIDIAN_ROUTER_*` for the geo router, `MERIDIAN_NODE_*` for a data-plane node.
`MERIDIAN_CLUSTER_TOKEN` is shared: nodes and routers present it to the control plane.
CLI flags override the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

_CLUSTER_TOKEN = Field(
    validation_alias=AliasChoices("MERIDIAN_CLUSTER_TOKEN", "cluster_token"),
    description="Shared secret nodes and routers present to the control plane.",
)


class ControlPlaneSettings(BaseSettings):
    """Settings of `meridian control-plane serve`."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_CP_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8081, ge=0, le=65535)
    database_url: str = "sqlite:///./meridian-state.db"
    cluster_token: SecretStr = _CLUSTER_TOKEN
    # Hash of this key is ensured at start-up as an admin-scoped key, so a fresh
    # deployment can create its first tenants. Unset in steady state.
    bootstrap_admin_key: SecretStr | None = None
    heartbeat_interval_s: float = Field(2.0, gt=0)
    # A node whose last heartbeat is older than this is marked lost and leaves the table.
    node_ttl_s: float = Field(10.0, gt=0)
    # Lost nodes are forgotten after this long.
    lost_node_retention_s: float = Field(3600.0, gt=0)
    reaper_interval_s: float = Field(1.0, gt=0)
    max_long_poll_s: float = Field(30.0, gt=0)
    max_request_bytes: int = Field(1_000_000, gt=0)
    onprem_inventory: Path | None = None
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


class RouterSettings(BaseSettings):
    """Settings of `meridian router serve`."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_ROUTER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    control_plane_url: str = "http://127.0.0.1:8081"
    cluster_token: SecretStr = _CLUSTER_TOKEN
    # Header an edge proxy you trust sets to the client's location ("lat,lon" or a
    # region name such as "aws:us-east-1"). Strip it at the edge from client requests.
    client_location_header: str = "x-meridian-client-location"
    # Where clients are assumed to be when no trusted header says otherwise.
    default_client_location: str = "aws:us-east-1"
    # Last routing table is kept here so a restarted router can serve while the
    # control plane is down.
    snapshot_path: Path | None = None
    table_poll_timeout_s: float = Field(20.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    # Upper bound on a whole upstream request (generation can be long).
    request_timeout_s: float = Field(300.0, gt=0)
    # Longest silence allowed between two chunks of a streamed answer.
    read_timeout_s: float = Field(60.0, gt=0)
    max_attempts: int = Field(3, ge=1, le=10)
    # A node that failed is skipped for this long (doubling on repeated failures).
    ejection_base_s: float = Field(5.0, gt=0)
    ejection_max_s: float = Field(60.0, gt=0)
    max_request_bytes: int = Field(1_000_000, gt=0)
    # Name of the RoutingPolicy (geo_router.selection registry) that orders replicas.
    routing_policy: str = "nearest"
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
    # Scale-from-zero: a request for a deployed model with no ready replica waits here
    # (at most this many per model) while the control plane is asked to scale it up.
    scale_from_zero_queue_size: int = Field(64, ge=1)
    # A held request that sees no ready replica within this long gets 503 + Retry-After.
    scale_from_zero_timeout_s: float = Field(120.0, gt=0)
    # While requests wait, the scale-up request is repeated this often (it is idempotent).
    scale_from_zero_reask_s: float = Field(15.0, gt=0)
    # Retry-After (seconds) sent with a scale-from-zero 503 (queue full or deadline passed).
    scale_from_zero_retry_after_s: int = Field(5, ge=1)
    # Timeout of one scale-up call to the control plane.
    scale_up_timeout_s: float = Field(5.0, gt=0)


class WeightSettings(BaseSettings):
    """The weight store and node cache, shared by nodes and `meridian model push/pull`
    (`MERIDIAN_WEIGHTS_*`). Cloud credentials come from the clouds' usual variables."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_WEIGHTS_", extra="ignore")

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
    # SigV4 and for residency checks. Keys: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
    # AWS_SESSION_TOKEN, as every AWS tool reads them.
    s3_endpoint_url: str | None = None
    s3_region: str = Field("us-east-1", validation_alias=AliasChoices("MERIDIAN_WEIGHTS_S3_REGION", "AWS_REGION", "s3_region"))
    # Unset: anonymous requests (public buckets).
    s3_access_key_id: str | None = Field(None, validation_alias=AliasChoices("AWS_ACCESS_KEY_ID", "s3_access_key_id"))
    s3_secret_access_key: SecretStr | None = Field(None, validation_alias=AliasChoices("AWS_SECRET_ACCESS_KEY", "s3_secret_access_key"))
    s3_session_token: SecretStr | None = Field(None, validation_alias=AliasChoices("AWS_SESSION_TOKEN", "s3_session_token"))
    # GCS JSON API: endpoint for emulators; bearer token, else the metadata server's.
    gcs_endpoint_url: str = "https://storage.googleapis.com"
    gcs_token: SecretStr | None = Field(None, validation_alias=AliasChoices("MERIDIAN_WEIGHTS_GCS_TOKEN", "GOOGLE_OAUTH_ACCESS_TOKEN", "gcs_token"))
    # Objects above this size are pushed to S3/GCS in parts of multipart_part_bytes.
    multipart_threshold_bytes: int = Field(64 * 1024 * 1024, ge=5 * 1024 * 1024)
    multipart_part_bytes: int = Field(64 * 1024 * 1024, ge=5 * 1024 * 1024)


class NodeSettings(BaseSettings):
    """Settings of `meridian node run`."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_NODE_", extra="ignore")

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
    drain_timeout_s: float = Field(30.0, ge=0)
    control_plane_timeout_s: float = Field(5.0, gt=0)
    # The weight store and cache (MERIDIAN_WEIGHTS_*), used when model_uri is set.
    weights: WeightSettings = Field(default_factory=WeightSettings)

    # --- vLLM adapter (engine = "vllm"): `vllm serve` run as a supervised child -------
    # What starts vLLM, before its "serve" argument: a command line ("vllm",
    # "python -m vllm.entrypoints.cli.main") or a JSON list of arguments.
    vllm_executable: str | list[str] = "vllm"
    # DeploymentSpec (meridian.deployment; JSON or YAML). Without one, it is derived
    # from this node's settings (model_name, max_model_len, lora_modules...).
    deployment_spec_file: Path | None = None
    # GPUs vLLM may use; unset: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`.
    vllm_gpu_count: int | None = Field(None, ge=1)
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


class CLISettings(BaseSettings):
    """Settings of the operator CLI (`meridian status`, `meridian keys …`)."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_", extra="ignore")

    control_plane_url: str = "http://127.0.0.1:8081"
    api_key: SecretStr | None = None
    timeout_s: float = Field(10.0, gt=0)
