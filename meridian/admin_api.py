"""The control plane's admin API as its clients see it: request and response bodies (pydantic v2).

The control plane serves these models and its clients (the CLI, the chaos tooling, the local
fabric, through `meridian.admin_client`) send and read them, so both sides share one
contract instead of clients building JSON bodies by hand; the layering rules keep clients
out of `control_plane`, hence the kernel. Region, node and deployment views, which other
planes read too, are in `meridian.contracts`.

The published OpenAPI document is built from these classes: their names, field order,
docstrings (schema descriptions) and constraints are part of the API. A class without a
docstring here has none on purpose, because adding one would change the published schema.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meridian.contracts import (
    DEFAULT_PRIORITY,
    DEFAULT_TENANT_WEIGHT,
    GLOBAL_ZONE,
    PRINTABLE_PATTERN,
    AutoscalingSpec,
    CacheGroupName,
    DisaggregationSpec,
    ModelName,
    NodeRole,
    NodeView,
    PlacementSpec,
    Priority,
    RegionInfo,
    TenantWeight,
    ZoneName,
)

# The media type of the admin API's error answers (RFC 9457 problem details, contracts.Problem).
PROBLEM_MEDIA_TYPE = "application/problem+json"

# --- health ----------------------------------------------------------------------------

# What a control plane's GET /health says it is (a router or a node says otherwise).
CONTROL_PLANE_SERVICE = "control-plane"


class ControlPlaneHealth(BaseModel):
    """The control plane is up and reaches its database. `service` tells it from a router or a
    node on a mistyped port; `instance_id` (MERIDIAN_CP_INSTANCE_ID, null when unset) from another
    control plane that later took the same port (the local fabric records its own)."""

    status: Literal["ok"] = "ok"
    service: Literal["control-plane"] = CONTROL_PLANE_SERVICE
    instance_id: str | None = None


# --- scopes ----------------------------------------------------------------------------


# Scopes an API key can carry (no docstring: it would become the schema's description).
class Scope(StrEnum):
    ADMIN = "admin"  # manage API keys, and everything below
    OPERATOR = "operator"  # operate the fleet
    READ_ONLY = "read-only"  # look at nodes and regions
    INFERENCE = "inference"  # call the global OpenAI endpoint (checked by routers)


# --- tenants ---------------------------------------------------------------------------

TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
RateLimit = Annotated[int, Field(ge=1, le=1_000_000_000)]


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TENANT_PATTERN)
    zone: ZoneName = GLOBAL_ZONE
    models: list[ModelName] | None = Field(None, max_length=64)
    requests_per_minute: RateLimit | None = None
    tokens_per_minute: RateLimit | None = None
    cache_group: CacheGroupName | None = Field(
        None, description="Tenants of one group share prefix-cache entries (and can see each other's "
        "cache hits); by default a tenant's cache is its own.")
    priority: Priority = Field(
        DEFAULT_PRIORITY, description="Dispatch priority band when requests wait for room: larger is more "
        "urgent; below 0 is sheddable (shed first when queues are full). A key can override it.")
    weight: TenantWeight = Field(
        DEFAULT_TENANT_WEIGHT, description="The tenant's share of work within its priority band, relative to the "
        "other tenants there.")


class TenantPatch(BaseModel):
    """Fields to change; those left out stay as they are (null clears a limit or model list)."""

    model_config = ConfigDict(extra="forbid")

    zone: ZoneName | None = None
    models: list[ModelName] | None = Field(None, max_length=64)
    requests_per_minute: RateLimit | None = None
    tokens_per_minute: RateLimit | None = None
    cache_group: CacheGroupName | None = None
    # Not clearable as a limit is: a tenant always has a band and a weight, so null is refused
    # (400, as for zone); send the default to reset one.
    priority: Priority | None = None
    weight: TenantWeight | None = None


class TenantView(BaseModel):
    name: str
    zone: str
    models: list[str] | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    cache_group: str | None = None
    # Defaults: what a control plane that predates flow control means by leaving them out.
    priority: int = DEFAULT_PRIORITY
    weight: float = DEFAULT_TENANT_WEIGHT
    resource_version: int
    created_at: datetime
    updated_at: datetime


# --- API keys --------------------------------------------------------------------------


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Shown in listings, the audit log and logs: no control characters (CR/LF forge lines).
    name: str = Field(min_length=1, max_length=200, pattern=PRINTABLE_PATTERN)
    # An existing tenant: a key for an unknown one is refused (404), since a mistyped name would
    # otherwise become a new tenant with a working key, unless create_tenant asks for one.
    tenant: str = Field(pattern=TENANT_PATTERN)
    # The tenant's zone when left out, and must be it when given; the new tenant's with create_tenant.
    zone: ZoneName | None = None
    scopes: list[Scope] = Field(min_length=1, max_length=len(Scope))
    models: list[ModelName] | None = Field(None, max_length=64)
    priority: Priority | None = Field(
        None, description="This key's dispatch priority band, overriding its tenant's (null: the tenant's).")
    create_tenant: bool = Field(
        False, description="Create the tenant in `zone` (required then) if it does not exist, in the "
        "same transaction as the key; without it a key for an unknown tenant is refused with 404.")

    @field_validator("scopes")
    @classmethod
    def _unique(cls, v: list[Scope]) -> list[Scope]:
        return sorted(set(v))

    @model_validator(mode="after")
    def _new_tenants_zone(self) -> ApiKeyCreate:
        # Residency is never a default: a tenant created here gets the zone the caller chose.
        if self.create_tenant and self.zone is None:
            raise ValueError("create_tenant needs the new tenant's zone (a residency zone, or global)")
        return self


class ApiKeyView(BaseModel):
    """A key as listings show it: never the key itself."""

    id: str
    name: str
    tenant: str
    # Its tenant's; null when the tenant has no row (deleted, its keys revoked with it; or the
    # bootstrap admin key's operator tenant).
    zone: str | None
    scopes: list[Scope]
    models: list[str] | None
    # Its own priority band; null: its tenant's.
    priority: int | None = None
    key_prefix: str
    created_at: datetime
    revoked_at: datetime | None = None


class ApiKeyCreated(ApiKeyView):
    """The answer to a creation: the only time the plaintext key is ever shown."""

    key: str
    tenant_created: bool = Field(False, description="This request created the key's tenant (create_tenant)")


# --- models ----------------------------------------------------------------------------

# Keys of control_plane.placement.fit.BYTES_PER_WEIGHT and KV_BYTES (a test keeps them in step).
Quantization = Literal["bf16", "fp16", "fp8", "int8", "int4", "awq", "gptq"]
KvCacheDtype = Literal["bf16", "fp16", "fp8", "int8"]
WEIGHTS_URI_PATTERN = r"^(file|s3|gs|https?)://[^\s\x00-\x1f\x7f]+$"


class ModelUpsert(BaseModel):
    """The body of PUT /v1/models/{name}: the model's shape and the workload one replica holds."""

    model_config = ConfigDict(extra="forbid")

    # At least a thousand parameters: smaller values only make the roofline's numbers overflow.
    params_b: float = Field(ge=1e-6, le=10_000, allow_inf_nan=False, description="parameters, billions")
    layers: int = Field(ge=1, le=1000)
    kv_heads: int = Field(ge=1, le=1024)
    head_dim: int = Field(ge=1, le=4096)
    quantization: Quantization = "bf16"
    kv_cache_dtype: KvCacheDtype = "bf16"
    attention_heads: int | None = Field(None, ge=1, le=4096)
    hidden_size: int | None = Field(None, ge=1, le=1_000_000)
    max_context: int = Field(8192, ge=1, le=10_000_000)
    target_concurrent_seqs: int = Field(16, ge=1, le=100_000)
    weights_uri: str | None = Field(None, max_length=2048, pattern=WEIGHTS_URI_PATTERN)

    @model_validator(mode="after")
    def _grouped_query_attention(self) -> ModelUpsert:
        if self.attention_heads is not None and self.attention_heads % self.kv_heads:
            raise ValueError("attention_heads must be a multiple of kv_heads")
        return self


class ModelView(BaseModel):
    """A model as the API shows it; send resource_version back as If-Match to update it."""

    name: str
    params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    quantization: str
    kv_cache_dtype: str
    attention_heads: int | None
    hidden_size: int | None
    max_context: int
    target_concurrent_seqs: int
    weights_uri: str | None
    resource_version: int
    created_at: datetime
    updated_at: datetime


# --- deployments -----------------------------------------------------------------------


class DeploymentUpsert(BaseModel):
    """The body of PUT /v1/deployments/{model}."""

    model_config = ConfigDict(extra="forbid")

    zone: ZoneName = GLOBAL_ZONE
    min_replicas: int = Field(0, ge=0, le=1000)
    max_replicas: int = Field(1, ge=1, le=1000)
    placement: PlacementSpec = PlacementSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    # Prefill/decode disaggregation; None (the default): co-located.
    disaggregation: DisaggregationSpec | None = None
    # In the same transaction, so that a deployment refused (a bad zone) leaves no model behind.
    model: ModelUpsert | None = Field(
        None, description="Register (or replace) the model's spec under the same name, in the same transaction "
        "as the deployment; left out, the registered model is left as it is.")

    @model_validator(mode="after")
    def _bounds(self) -> DeploymentUpsert:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


# --- model fit -------------------------------------------------------------------------


class OfferingCost(BaseModel):
    """The offering that serves a model's tokens cheapest on one SKU, at full load."""

    provider: str
    region: str
    instance_type: str
    gpu_count: int
    replicas_per_instance: int
    price_per_hour: float
    spot: bool
    usd_per_million_tokens: float


class SkuFitView(BaseModel):
    """One replica of the model on one SKU: GPUs it needs, memory per GPU, roofline throughput."""

    sku: str
    tensor_parallel: int = Field(description="GPUs per replica (the smallest TP degree that fits)")
    weights_gib_per_gpu: float
    kv_cache_gib_per_gpu: float
    overhead_gib_per_gpu: float
    used_gib_per_gpu: float
    usable_gib_per_gpu: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    cheapest: OfferingCost | None = Field(description="None when no provider offers the SKU at a price")


class ModelFitView(BaseModel):
    model: str
    resource_version: int
    fits: list[SkuFitView] = Field(description="SKUs the model fits on, cheapest per token first")
    does_not_fit: list[str] = Field(description="SKUs too small even at the largest TP degree")


# --- audit log -------------------------------------------------------------------------


class AuditEntryView(BaseModel):
    """One change: when, who (API key id and name, or system:<component>), what, before and after."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    actor_id: str
    actor_name: str
    action: str
    resource_type: str
    resource_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    request_id: str | None


# --- placement plans -------------------------------------------------------------------


class PlanRequest(BaseModel):
    """Solver limits for one preview."""

    model_config = ConfigDict(extra="forbid")

    time_limit_s: float = Field(10.0, gt=0, le=120)
    mip_rel_gap: float = Field(0.005, ge=0, le=0.5)


class PlanStatus(StrEnum):
    """A placement plan's state (PlanView.status; the database column stays a string)."""

    PREVIEW = "preview"  # the newest plan, waiting to be applied
    APPLIED = "applied"  # the placement in force
    SUPERSEDED = "superseded"  # replaced in force (applied_at set), or a preview a newer plan overtook
    INFEASIBLE = "infeasible"


class PlanView(BaseModel):
    id: str
    status: str
    base_plan_id: str | None
    cost_per_hour: float | None
    assignments: list[dict[str, Any]]
    diff: dict[str, Any]
    explanation: str | None
    solve_seconds: float
    created_at: datetime
    created_by: str
    applied_at: datetime | None
    applied_by: str | None


# --- fleet loops: reconciler and autoscaler ---------------------------------------------


class ReconcilerState(StrEnum):
    """How far the reconciler has brought the node groups to the placement in force."""

    NO_PLAN = "no_plan"  # no plan applied yet
    IN_FORCE = "in_force"  # every node group holds the nodes it should, and no step is failing
    RECONCILING = "reconciling"  # some group is still growing, shrinking or draining
    FAILING = "failing"  # some group's last step failed; it is retried with backoff


class NodeGroupProgress(BaseModel):
    """One node group the placement in force asks for (or one it dropped, being removed):
    the nodes it should have against those its provider holds, and the reconciler's last error."""

    model: str
    provider: str
    region: str
    instance_type: str
    sku: str
    spot: bool
    role: NodeRole
    group_id: str | None = Field(description="None: the reconciler has not created it yet")
    desired: int = Field(description="Nodes the plan in force and the autoscaler's replica count ask for")
    actual: int = Field(description="Nodes the provider holds for the group")
    ready: int = Field(description="Of those, nodes registered and ready")
    state: str | None = Field(description="The node group's state (creating, ready, scaling, draining, deleting, error)")
    failures: int = Field(description="Consecutive failed steps")
    last_error: str | None
    error_at: datetime | None = Field(description="When the last error happened")
    retry_at: datetime | None = Field(description="When the failed step is tried again")


class ReconcilerStatus(BaseModel):
    """The placement in force against what the providers hold: one word for the whole, a line
    saying why, and each node group's desired and actual nodes."""

    state: ReconcilerState
    summary: str
    plan_id: str | None
    groups: list[NodeGroupProgress]


class AutoscalerDecisionView(BaseModel):
    id: int
    model: str
    at: datetime
    mode: str
    current: int
    desired: int
    reason: str
    inputs: dict[str, Any]
    epoch: int


class AutoscalerStatus(BaseModel):
    """One deployment's pool as the autoscaler keeps it: its bounds, the replicas ready now and
    desired, and the last decision the autoscaler recorded for it (with its reason)."""

    model: str
    pool: NodeRole = Field(description="both: a co-located deployment; prefill or decode: a disaggregated one's pool")
    min_replicas: int
    max_replicas: int
    ready: int
    desired: int
    last_decision: AutoscalerDecisionView | None


# --- web console -----------------------------------------------------------------------


class ConsoleViewer(BaseModel):
    """The key the console was opened with: the console offers only what its scopes allow."""

    name: str
    tenant: str
    scopes: list[Scope]


class PoolHeldView(BaseModel):
    """Requests held at the routers for one (residency zone, model) pool, and how many routers hold them."""

    zone: str
    model: str
    waiting: int
    routers: int


class ConsoleOverview(BaseModel):
    """One poll of the web console: the fleet as this control plane sees it now.

    Ages are measured against generated_at (the clock heartbeats are stamped with), never the browser's.
    Request rates come from successive polls: each node's load carries cumulative counts.
    """

    generated_at: datetime
    viewer: ConsoleViewer
    routing_version: int
    heartbeat_interval_s: float
    node_ttl_s: float
    regions: list[RegionInfo]
    nodes: list[NodeView]
    # Requests routers' flow control holds per (zone, model) pool, from fresh reports.
    router_backlog: list[PoolHeldView] = []


class DrillReportSummary(BaseModel):
    """A chaos drill report found in the control plane's drill reports directory."""

    name: str = Field(description="The report's directory; its report.json and timeline.png are under it")
    drill: str
    started_at: str | None = None
    duration_s: float | None = None
    passed: bool | None = None
    fault: str | None = None
    recovery_s: float | None = None
    timeline_png: bool = False
