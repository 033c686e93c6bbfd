"""A data-plane node's settings (`meridian node run`, `MERIDIAN_NODE_*`, section `node:`) and
its weight store's (`MERIDIAN_WEIGHTS_*`, section `weights:`), which `meridian model push`
and `pull` read too."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from meridian.contracts import KVConnector, NodeRole
from meridian.settings.base import FileSettings, ListenerSettings


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
