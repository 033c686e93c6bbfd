"""Wire contracts between Meridian's processes (pydantic v2).

Everything that crosses a process boundary between the control plane, the geo router
and the data-plane nodes is defined here, so that no plane imports another.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from meridian import residency
from meridian.residency import GLOBAL_ZONE

# Providers are registered by name (providers.provider.PROVIDERS; the kernel does not know
# which), so the kernel accepts any well-formed name and the layer that holds the registry
# (the control plane, the CLI, chaos) refuses one that is not registered.
PROVIDER_PATTERN = r"^[a-z][a-z0-9-]{0,15}$"
# Region names are "<provider>:<location>", e.g. "aws:us-east-1", "onprem:tokyo-1".
REGION_PATTERN = r"^[a-z][a-z0-9-]{0,15}:[a-z0-9][a-z0-9-]{0,62}$"
NODE_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
# Residency zones are short lowercase names; "global" means "may be served anywhere"
# (meridian.residency owns the rule).
ZONE_PATTERN = r"^[a-z][a-z0-9-]{0,31}$"

# Response headers the router sets so a client can see where it was served.
HEADER_REGION = "x-meridian-region"
HEADER_NODE = "x-meridian-node"


class Route(StrEnum):
    """The inference API's routes whose body names a model, at the router and passed
    through by vLLM nodes (each written once, here)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"
    COUNT_TOKENS = "/v1/messages/count_tokens"
    EMBEDDINGS = "/v1/embeddings"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"


# Routes whose answer is a generation, then every route whose body names a model.
GENERATION_ROUTES = (Route.CHAT, Route.COMPLETIONS, Route.RESPONSES, Route.MESSAGES)
MODEL_ROUTES = tuple(Route)
HEADER_REQUEST_ID = "x-request-id"
# A request id the router keeps from its client (else it makes one) and that every process
# logs: a token with no room for log or header injection.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
HEADER_OVERHEAD_MS = "x-meridian-overhead-ms"
# Longest a node waits between heartbeat retries while the control plane does not answer;
# after an outage the control plane waits this long (plus the TTL) before expiring anyone.
HEARTBEAT_RETRY_MAX_S = 10.0

ProviderName = Annotated[str, Field(pattern=PROVIDER_PATTERN)]
RegionName = Annotated[str, Field(pattern=REGION_PATTERN)]
NodeId = Annotated[str, Field(pattern=NODE_ID_PATTERN)]
ZoneName = Annotated[str, Field(pattern=ZONE_PATTERN)]
# Free text that is safe to store and log: no control characters (Postgres refuses NUL in text).
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
ModelName = Annotated[str, Field(min_length=1, max_length=200, pattern=PRINTABLE_PATTERN)]
# A prefix-cache sharing group of tenants (see TenantEntry.cache_group).
CACHE_GROUP_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
CacheGroupName = Annotated[str, Field(pattern=CACHE_GROUP_PATTERN)]
# A tenant's (or one key's) dispatch priority in routers' flow control (issue 37): larger is
# more urgent, and a band below SHEDDABLE_BELOW is shed first when a queue is full. Bounded so
# that bands stay a handful an operator can reason about, not a second weight.
PRIORITY_MIN, PRIORITY_MAX, DEFAULT_PRIORITY = -10, 10, 0
SHEDDABLE_BELOW = 0
Priority = Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)]
# A tenant's share of work within its priority band, relative to the other tenants there.
# Finite and bounded: a weight divides the work charged to the tenant, so 0, inf or nan would
# give it every dispatch or none.
TENANT_WEIGHT_MAX, DEFAULT_TENANT_WEIGHT = 1000.0, 1.0
TenantWeight = Annotated[float, Field(gt=0, le=TENANT_WEIGHT_MAX, allow_inf_nan=False)]
# A ZMQ endpoint a router can connect to: tcp://host:port (IPv6 host in brackets) or
# ipc://path. Wildcard hosts ("*") are bind addresses, not connectable, so they are refused.
ZMQ_ENDPOINT_PATTERN = (
    r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9._-]*):[0-9]{1,5}|ipc://[^\x00-\x20\x7f]+)$"
)


def _connectable_port(v: str) -> str:
    if v.startswith("tcp://") and not 0 < int(v.rsplit(":", 1)[1]) <= 65535:
        raise ValueError("port must be 1-65535")
    return v


ZmqEndpoint = Annotated[
    str, Field(max_length=256, pattern=ZMQ_ENDPOINT_PATTERN), AfterValidator(_connectable_port)
]
# A vLLM tool-call parser's name as `--tool-call-parser` takes it ("pythonic", "hermes",
# "llama3_json", "granite-20b-fc", or a plugin's): a short identifier, nothing to interpret.
TOOL_CALL_PARSER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
ToolCallParserName = Annotated[str, Field(max_length=64, pattern=TOOL_CALL_PARSER_PATTERN)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _is_none(value: object) -> bool:
    return value is None


# An optional field left out of the JSON while unset, so that peers of an older version
# (extra="forbid") still accept what a newer one sends when it does not use the field.
_OMITTED_WHEN_UNSET = Field(None, exclude_if=_is_none)


class NodeStatus(StrEnum):
    """Lifecycle of a data-plane node as the control plane sees it."""

    STARTING = "starting"  # registered, runtime still loading weights
    READY = "ready"  # serving; routers may send traffic
    DRAINING = "draining"  # finishing in-flight requests; routers send nothing new
    LOST = "lost"  # heartbeats stopped; kept for a while so status can show it


class EngineKind(StrEnum):
    """The runtime a node serves with (data_plane.engine's registry names)."""

    TORCH = "torch"  # the built-in engine
    VLLM = "vllm"  # vLLM's OpenAI server, requests passed through


class NodeCapability(StrEnum):
    """What a node's engine does with a request that the router shapes its requests by: the
    router asks a node what it can do, never which engine it runs."""

    # Honours `include_stop_str_in_output`: a stream asked to include its stop strings holds
    # none of its text back (a migrated stream's continuation is asked so).
    STOP_STRING_IN_OUTPUT = "stop_string_in_output"
    # Takes `add_special_tokens` on a chat request, tokenizing its prompt as its own Responses
    # path would (a Responses request served as chat is asked so).
    CHAT_SPECIAL_TOKENS = "chat_special_tokens"


# What a node of each engine can do, for a node whose agent predates `capabilities` (it
# registers without them) and for a routing table of such a control plane.
ENGINE_CAPABILITIES: dict[str, tuple[NodeCapability, ...]] = {
    EngineKind.TORCH: (),
    EngineKind.VLLM: (NodeCapability.STOP_STRING_IN_OUTPUT, NodeCapability.CHAT_SPECIAL_TOKENS),
}


class NodeRole(StrEnum):
    """What a node does for a prefill/decode disaggregated deployment (DESIGN.md)."""

    BOTH = "both"  # co-located: prefills and decodes its own requests (every node before P/D)
    PREFILL = "prefill"  # computes prompts' KV and hands it to a decode worker
    DECODE = "decode"  # pulls a prompt's KV from a prefill worker and generates


class KVConnector(StrEnum):
    """How a node's KV blocks move between a prefill and a decode worker."""

    # vLLM's NIXL connector: UCX (RDMA on GPUs; host memory over TCP with kv_buffer_device cpu).
    NIXL = "NixlConnector"
    # The torch engine's: the decode node pulls the blocks from the prefill node's HTTP API.
    MERIDIAN = "MeridianConnector"


# host:port (IPv6 host in brackets) where a node's peers pull KV: the NIXL side channel, or
# the torch node's own listener.
KV_ENDPOINT_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9._-]*):[0-9]{1,5}$"


class KVTransferInfo(_Wire):
    """A disaggregated node's KV transfer: its connector, where peers reach it, and how long
    a prefill worker keeps a request's blocks for the decode worker that has not pulled them
    (after that the decode worker must have the prompt prefilled again)."""

    connector: KVConnector
    endpoint: str = Field(max_length=262, pattern=KV_ENDPOINT_PATTERN)
    lease_s: float = Field(gt=0, le=86_400, allow_inf_nan=False)


def _is_both(value: object) -> bool:
    return value is NodeRole.BOTH or value == NodeRole.BOTH.value


# A node's role, left out of the JSON when co-located, so peers of an older version
# (extra="forbid") still accept what every co-located node sends.
_ROLE = Field(NodeRole.BOTH, exclude_if=_is_both)
# A node's capabilities (NodeCapability), left out while unset: an older agent said none.
_CAPABILITIES = Field(None, max_length=32, exclude_if=_is_none)
# A node's batch slots, left out while unset so that peers of an older version accept it.
_SLOTS = Field(None, ge=1, le=65_536, exclude_if=_is_none)


class NodeLoad(_Wire):
    """Load figures a node reports with each heartbeat (vLLM's metric semantics)."""

    running: int = Field(0, ge=0)
    waiting: int = Field(0, ge=0)
    kv_cache_usage: float = Field(0.0, ge=0.0, le=1.0)
    # LoRA adapters resident on the node now: a request for one of them starts without a load.
    lora_adapters: list[ModelName] = Field(default_factory=list, max_length=256)
    # Prompt tokens of the requests waiting for their prefill (None: not measured): what a
    # prefill pool is scaled on, as a decode pool is on running sequences and KV usage.
    waiting_prompt_tokens: int | None = Field(None, ge=0, exclude_if=_is_none)
    # Cumulative since the node started: requests it finished and the sum of their end-to-end
    # latencies (vllm:e2e_request_latency_seconds' count and sum). Successive heartbeats give
    # a request rate and a mean latency (the web console draws them per region); None from a
    # node that does not measure them, and left out of the JSON then, so that control planes
    # that predate the fields still accept the heartbeat.
    requests_completed: int | None = Field(None, ge=0, exclude_if=_is_none)
    latency_s_sum: float | None = Field(None, ge=0, allow_inf_nan=False, exclude_if=_is_none)


class NodeRegistration(_Wire):
    """What a node sends when it (re)starts: who it is, where, what it serves."""

    node_id: NodeId
    region: RegionName
    url: str = Field(description="Base URL routers use to reach the node, e.g. http://10.0.0.5:8000")
    models: list[ModelName] = Field(default_factory=list, max_length=64)
    engine: EngineKind = EngineKind.TORCH
    # What its engine does that routers shape requests by; None (an older agent): what its
    # engine kind could do then (ENGINE_CAPABILITIES).
    capabilities: list[NodeCapability] | None = _CAPABILITIES
    version: str = Field("", max_length=64)
    status: NodeStatus = NodeStatus.STARTING
    # Where routers subscribe to the node's KV cache events (ZMQ PUB, vLLM's format) and
    # ask for missed batches (ZMQ ROUTER replay); None when the node publishes none.
    kv_events: ZmqEndpoint | None = _OMITTED_WHEN_UNSET
    kv_events_replay: ZmqEndpoint | None = _OMITTED_WHEN_UNSET
    # The parser that turns the model's text into tool calls when it chooses them itself
    # (vLLM's --tool-call-parser); None when the node parses none (no auto tool choice, or
    # the torch engine). Routers resume a broken tool-call stream only where they can
    # replay its parser (geo_router.forwarding.migration.decide).
    tool_call_parser: ToolCallParserName | None = _OMITTED_WHEN_UNSET
    # Prefill/decode disaggregation: the node's role and, unless co-located, its KV transfer.
    role: NodeRole = _ROLE
    kv_transfer: KVTransferInfo | None = _OMITTED_WHEN_UNSET
    # Sequences its engine runs at once (vLLM's max_num_seqs): what routers' flow control
    # fills a node to before holding requests at the router (geo_router.admission.flow_control);
    # None, an older agent: the router's default.
    max_num_seqs: int | None = _SLOTS

    @model_validator(mode="after")
    def _disaggregated_has_transfer(self) -> NodeRegistration:
        if self.role is not NodeRole.BOTH and self.kv_transfer is None:
            raise ValueError(f"a {self.role.value} node must say how its KV moves (kv_transfer)")
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/]+(:\d+)?/?$", v):
            raise ValueError("url must be http(s)://host[:port]")
        return v.rstrip("/")


class NodeRegistered(_Wire):
    """Control plane's answer to a registration: how often to heartbeat."""

    node_id: NodeId
    heartbeat_interval_s: float
    ttl_s: float


Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ColdStart(_Wire):
    """How long this node took from agent start to each step of its start, in seconds
    (None until the step is reached), and where its weights came from."""

    weights_cached_s: float | None = Field(None, ge=0)
    loaded_s: float | None = Field(None, ge=0)
    ready_s: float | None = Field(None, ge=0)
    # "cache" (already on disk), "peer", "origin" or "peer+origin".
    weights_source: str | None = Field(None, max_length=32)
    fetched_bytes: int = Field(0, ge=0)


class NodeHeartbeat(_Wire):
    """Periodic liveness + load report from a node."""

    status: NodeStatus
    load: NodeLoad = NodeLoad()
    models: list[ModelName] = Field(default_factory=list, max_length=64)
    # Manifest digests of the models in the node's weight cache, which same-region peers
    # may fetch from it; None leaves what the control plane knows unchanged.
    weights: list[Sha256Hex] | None = Field(None, max_length=1024)
    cold_start: ColdStart | None = None


class WeightSourcesRequest(_Wire):
    """A node about to fetch a model asks which same-region peers can serve it."""

    node_id: NodeId
    # The model's residency zone (from its manifest) and where its origin stores it.
    zone: ZoneName = GLOBAL_ZONE
    origin_region: RegionName | None = None


class WeightPeer(_Wire):
    node_id: NodeId
    url: str
    # "cached": has every byte; "fetching": downloading now and serves chunks as they land.
    state: Literal["cached", "fetching"]


class WeightSources(_Wire):
    """Peers to fetch from, best first. The asking node is recorded as fetching, so the
    next node of its region is sent to it instead of to the origin."""

    peers: list[WeightPeer]
    node_zones: list[ZoneName]


class HeartbeatAck(_Wire):
    routing_version: int
    # How long to wait for the next heartbeat (s): the control plane lengthens it as the fleet
    # grows (control_plane.heartbeat_pacing). A node follows the latest one it was told; an
    # older node that ignores it keeps the interval of its registration, which stays safe.
    heartbeat_interval_s: float | None = _OMITTED_WHEN_UNSET


class RegionInfo(_Wire):
    """A region as routers see it: where it is and which residency zones it belongs to."""

    name: RegionName
    provider: ProviderName
    location: str
    zones: list[ZoneName]
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)

    def admits(self, zone: str) -> bool:
        """Residency, the one rule every layer asks: may a tenant's request or a deployment's
        replica of `zone` be served or placed in this region? `global` may go anywhere."""
        return residency.admits(self.zones, zone)


class RoutingNode(_Wire):
    """One node in the routing table. Load is not here: it changes every heartbeat and
    would make every snapshot a new version; routers learn load from nodes directly."""

    node_id: NodeId
    region: RegionName
    url: str
    models: list[ModelName]
    status: NodeStatus
    engine: EngineKind = EngineKind.TORCH
    # See NodeRegistration; absent from an older control plane's tables.
    capabilities: list[NodeCapability] | None = _CAPABILITIES
    # The node's KV event endpoints and tool-call parser (see NodeRegistration); absent in
    # old snapshots.
    kv_events: ZmqEndpoint | None = _OMITTED_WHEN_UNSET
    kv_events_replay: ZmqEndpoint | None = _OMITTED_WHEN_UNSET
    tool_call_parser: ToolCallParserName | None = _OMITTED_WHEN_UNSET
    # The node's P/D role and KV transfer (see NodeRegistration); co-located when absent.
    role: NodeRole = _ROLE
    kv_transfer: KVTransferInfo | None = _OMITTED_WHEN_UNSET
    max_num_seqs: int | None = _SLOTS  # see NodeRegistration

    def can(self, capability: NodeCapability) -> bool:
        """Whether the node's engine does `capability` (as it registered, or as its kind did)."""
        held = self.capabilities if self.capabilities is not None else ENGINE_CAPABILITIES.get(self.engine, ())
        return capability in held


def _is_default_priority(value: object) -> bool:
    return value == DEFAULT_PRIORITY


def _is_default_weight(value: object) -> bool:
    return value == DEFAULT_TENANT_WEIGHT


def allows_model(models: Sequence[str] | None, model: str) -> bool:
    """Whether a model list (None: every model) allows `model`; a listed base model allows
    its LoRA adapters `base:adapter`. One rule for the control plane and the routers."""
    return models is None or model in models or model.partition(":")[0] in models


def intersect_models(key: Sequence[str] | None, tenant: Sequence[str] | None) -> list[str] | None:
    """What a key may use: its own list within its tenant's (None: every model). A key
    narrows its tenant's models and never widens them, also after the tenant's list changes."""
    if key is None or tenant is None:
        chosen = key if tenant is None else tenant
        return list(chosen) if chosen is not None else None
    both = [m for m in key if allows_model(tenant, m)]
    return both + [m for m in tenant if allows_model(key, m) and m not in both]


class TenantEntry(_Wire):
    """An inference API key as routers need it: hash only, never the key itself."""

    key_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    key_prefix: str
    tenant: str
    zone: ZoneName
    models: list[ModelName] | None = Field(None, description="None means every model")
    # The tenant's rate limits (None: unlimited), enforced by routers.
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    # Tenants of one group share prefix-cache entries (an operator's opt-in); None: the
    # tenant's cache is its own (routers salt every request per tenant).
    cache_group: CacheGroupName | None = _OMITTED_WHEN_UNSET
    # Flow control (issue 37): the key's priority band (its own override, else its tenant's)
    # and its tenant's weight within the band. Left out of the JSON at their defaults, so
    # that routers of an older version (extra="forbid") still accept tables of default tenants.
    priority: Priority = Field(DEFAULT_PRIORITY, exclude_if=_is_default_priority)
    weight: TenantWeight = Field(DEFAULT_TENANT_WEIGHT, exclude_if=_is_default_weight)

    def may_use(self, model: str) -> bool:
        return allows_model(self.models, model)

    @property
    def sheddable(self) -> bool:
        """Whether a full queue may shed this key's waiting requests to make room."""
        return self.priority < SHEDDABLE_BELOW


class RoutingTable(_Wire):
    """Versioned snapshot routers poll (ETag = version). Routers keep using the last
    one they have when the control plane is unreachable (static stability)."""

    version: int = Field(ge=0)
    generated_at: datetime
    regions: list[RegionInfo]
    nodes: list[RoutingNode]
    tenants: list[TenantEntry]
    # Deployments a router may ask to scale up (scale-from-zero); absent in old snapshots.
    deployments: list[DeploymentEntry] = Field(default_factory=list)


# Incremental routing-table stream (RFC 3229 delta encoding, as Envoy's incremental xDS):
# a router that holds version V of build B asks `GET /v1/routing-table` with
# `If-None-Match: "V"`, `A-IM: meridian-delta` and `X-Meridian-Table-Build: B`; a control
# plane that still holds that very build answers `226 IM Used` (`IM: meridian-delta`) with
# a RoutingTableDelta, else `200` with the full RoutingTable. Every 200 and 226 names the
# build it is (or leads to) in `X-Meridian-Table-Build`. A control plane that knows no deltas
# ignores both request headers and answers 200: the router takes the full table.
TABLE_DELTA_IM = "meridian-delta"
HEADER_TABLE_BUILD = "x-meridian-table-build"
TABLE_BUILD_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class RoutingTableDelta(_Wire):
    """What changed in the routing table from (base_version, base_build) to (version, build).

    Nodes travel one by one (upserted whole, removed by id); regions, tenants and deployments
    are small and travel whole when any of them changed (None: unchanged). Applied to exactly
    the base build, the result equals the full table of `build`, order included (nodes by
    node_id)."""

    base_version: int = Field(ge=0)
    base_build: str = Field(pattern=TABLE_BUILD_PATTERN)
    version: int = Field(ge=0)
    build: str = Field(pattern=TABLE_BUILD_PATTERN)
    generated_at: datetime
    nodes_upserted: list[RoutingNode] = Field(default_factory=list)
    nodes_removed: list[NodeId] = Field(default_factory=list)
    regions: list[RegionInfo] | None = None
    tenants: list[TenantEntry] | None = None
    deployments: list[DeploymentEntry] | None = None


class NodeView(_Wire):
    """A node as the admin API and `meridian status` show it."""

    node_id: NodeId
    region: RegionName
    provider: str
    url: str
    models: list[str]
    engine: str
    version: str
    status: NodeStatus
    load: NodeLoad
    registered_at: datetime
    last_heartbeat: datetime
    cold_start: ColdStart | None = None
    weights: list[str] = Field(default_factory=list)
    # Its prefill/decode role and KV transfer, as it registered them (co-located when absent).
    role: NodeRole = _ROLE
    kv_transfer: KVTransferInfo | None = _OMITTED_WHEN_UNSET


# --- OpenAI-compatible listing and errors ---------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "meridian"
    # vLLM's lineage fields: the model this one derives from (`parent`, set on LoRA
    # adapters) and the base of that lineage (`root`). Left out of the JSON when unset.
    root: str | None = None
    parent: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_lineage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("root", "parent"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """The body OpenAI's API (and its clients) expect on every error."""

    error: OpenAIErrorDetail


def openai_error(
    message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """Build an OpenAI error JSON body."""
    return OpenAIErrorBody(
        error=OpenAIErrorDetail(message=message, type=type_, code=code, param=param)
    ).model_dump()


class FieldError(BaseModel):
    """One field that failed validation, in a 422 problem's `errors`."""

    loc: list[str | int] = Field(description="Where: 'body', 'query', 'path' or 'header', then the field's path")
    msg: str = Field(description="What is wrong, for a person")
    type: str = Field(description="The kind of error, for a program (e.g. 'missing', 'string_too_long')")


class Problem(BaseModel):
    """RFC 9457 problem details: the one error body of the admin API."""

    type: str = Field("about:blank", description="Always 'about:blank': the status says what went wrong")
    title: str = Field(description="The HTTP status' standard phrase")
    status: int = Field(description="The HTTP status code")
    detail: str | None = Field(None, description="What went wrong with this request, for a person")
    errors: list[FieldError] | None = Field(None, description="On a 422: each field that failed validation")


# --- deployments and scale-from-zero ---------------------------------------------------

# Response header: how long the router held a request while its model scaled from zero.
HEADER_SCALE_WAIT_MS = "x-meridian-scale-wait-ms"
# Response header: how long flow control held a request for room on its zone's replicas.
HEADER_QUEUE_WAIT_MS = "x-meridian-queue-wait-ms"


class DeploymentEntry(_Wire):
    """A deployment as routers see it: a model, where its replicas may run, how far it scales.

    A router holds requests for a deployed model that has no ready replica (min_replicas
    may be 0) and asks the control plane to scale it up, instead of answering at once.
    """

    model: ModelName
    zone: ZoneName
    min_replicas: int = Field(ge=0)
    max_replicas: int = Field(ge=1)


class PlacementSpec(_Wire):
    """Where a deployment's replicas may go and how much they must serve (placement input)."""

    # Decode tokens/s each client region sends; replicas within the RTT objective of a
    # client region serve its demand.
    demand: dict[RegionName, Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=64
    )
    # Or (and) replica counts: at least this many replicas within the RTT objective of each
    # client region. With neither, one replica in each of min_regions regions.
    replicas: dict[RegionName, Annotated[int, Field(ge=0, le=1000)]] = Field(default_factory=dict, max_length=64)
    # Active-active: replicas in at least this many regions, of at least this many
    # providers (capped at what the deployment's zone offers).
    min_regions: int = Field(2, ge=1, le=16)
    min_providers: int = Field(2, ge=1, le=3)
    # A replica serves a client region only if the estimated RTT between them is within this.
    rtt_objective_ms: float = Field(100.0, gt=0, le=1000)
    # Canonical GPU SKUs (providers.skus) the deployment may run on; None: any that fits.
    allowed_skus: list[Annotated[str, Field(min_length=1, max_length=32)]] | None = Field(None, max_length=32)
    spot: bool = False


class AutoscalingSpec(_Wire):
    """Knative-KPA-style autoscaling of a deployment between min and max replicas."""

    # In-flight requests (running + waiting) one replica should carry.
    target_concurrency: float = Field(8.0, gt=0, le=10_000)
    # Averaging window of the stable mode, and of the panic mode as a percentage of it.
    stable_window_s: float = Field(60.0, ge=6, le=3600)
    panic_window_pct: float = Field(10.0, ge=1, le=100)
    # Enter panic mode when the panic-window concurrency needs this % of current capacity;
    # in panic the autoscaler only scales up.
    panic_threshold_pct: float = Field(200.0, ge=110, le=1000)
    # A scale-down happens only after the lower count was wanted for this long.
    scale_down_delay_s: float = Field(60.0, ge=0, le=3600)
    # Largest step up (x current) and down (÷ current) in one decision.
    max_scale_up_rate: float = Field(1000.0, gt=1)
    max_scale_down_rate: float = Field(2.0, gt=1)


class PoolSizes(_Wire):
    """A region's prefill and decode pools of a disaggregated deployment, in replicas."""

    prefill: int = Field(ge=1, le=1000)
    decode: int = Field(ge=1, le=1000)


class DisaggregationSpec(_Wire):
    """Prefill/decode disaggregation of a deployment: in every region it runs, a prefill pool
    computes prompts' KV and hands it over `connector` to a decode pool of the same region,
    so KV never leaves the region (nor its zone). A deployment without one is co-located.

    Pool sizes come, in this order, from `pools` (per region), from `prefill_per_decode`, or
    from model fit on the placed SKU and the prompt/generation mix (prefill is compute-bound,
    decode memory-bound). The deployment's min/max/desired replicas count its decode pool.
    """

    connector: KVConnector = KVConnector.NIXL
    # Explicit pool sizes per region (placement puts both pools there or nowhere).
    pools: dict[RegionName, PoolSizes] = Field(default_factory=dict, max_length=64)
    # Prefill replicas per decode replica elsewhere; None: fit derives it from the mix.
    prefill_per_decode: float | None = Field(None, gt=0, le=64, allow_inf_nan=False)
    # The prompt/generation mix: mean prompt and generated tokens per request.
    mean_prompt_tokens: int = Field(1024, ge=1, le=10_000_000)
    mean_output_tokens: int = Field(256, ge=1, le=1_000_000)
    # The prefill pool's bounds (the decode pool's are the deployment's min/max replicas) and
    # its autoscaling target: prompt tokens waiting for prefill that one prefill replica carries.
    min_prefill_replicas: int = Field(1, ge=0, le=1000)
    max_prefill_replicas: int = Field(8, ge=1, le=1000)
    target_waiting_prompt_tokens: int = Field(8192, ge=1, le=100_000_000)

    @model_validator(mode="after")
    def _prefill_bounds(self) -> DisaggregationSpec:
        if self.min_prefill_replicas > self.max_prefill_replicas:
            raise ValueError("min_prefill_replicas must not exceed max_prefill_replicas")
        return self


class DeploymentView(_Wire):
    """A deployment as the admin API, `meridian status` and scalers see it."""

    model: ModelName
    zone: ZoneName
    min_replicas: int = Field(ge=0)
    max_replicas: int = Field(ge=1)
    desired_replicas: int = Field(ge=0)
    placement: PlacementSpec = PlacementSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    # Prefill/decode pools; absent: co-located. desired_prefill_replicas: the prefill pool's
    # count now (the autoscaler's), as desired_replicas is the decode pool's.
    disaggregation: DisaggregationSpec | None = _OMITTED_WHEN_UNSET
    desired_prefill_replicas: int | None = Field(None, ge=0, exclude_if=_is_none)
    # Optimistic concurrency: send it back as If-Match to update.
    resource_version: int = Field(1, ge=1)
    # The last scale-up request: when, why, and the region of the client that waited.
    last_scale_request_at: datetime | None = None
    last_scale_reason: str | None = None
    last_scale_region: RegionName | None = None
    created_at: datetime
    updated_at: datetime


class ScaleUpRequest(_Wire):
    """A router asking the control plane for at least one replica of a deployment."""

    reason: str = Field("scale-from-zero", min_length=1, max_length=200)
    queued_requests: int = Field(0, ge=0)
    # Where the waiting client is and which zone its tenant is confined to: hints for
    # placing the replica where it can serve the requests that wait.
    client_region: RegionName | None = None
    zone: ZoneName | None = None


# A router's name in its backlog reports: host, port and worker, as the router composes it.
ROUTER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
RouterId = Annotated[str, Field(pattern=ROUTER_ID_PATTERN)]


# What one backlog report names at most: a router reports its largest pools.
MAX_BACKLOG_POOLS = 1000


class PoolBacklog(_Wire):
    """Requests one router's flow control holds for a (residency zone, model) pool."""

    zone: ZoneName
    model: ModelName
    waiting: int = Field(ge=0, le=10_000_000)


class RouterBacklog(_Wire):
    """What a router's flow control holds now, per pool (`PUT /v1/routers/{id}/backlog`).

    Flow control keeps the nodes' queues short and holds the backlog at the routers, where
    the nodes' heartbeats (running + waiting) cannot show it: the autoscaler adds these
    reports to them, and the console shows them. A report replaces the router's previous
    one; an empty one says nothing waits there any more.
    """

    pools: list[PoolBacklog] = Field(default_factory=list, max_length=MAX_BACKLOG_POOLS)


RoutingTable.model_rebuild()
