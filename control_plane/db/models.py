"""SQLAlchemy 2 models of the control plane's state (portable across SQLite and Postgres)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# Named constraints let Alembic's batch mode (SQLite) and autogenerate address them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    SQLite keeps no offset, so values are normalised to UTC on the way in and tagged as
    UTC on the way out; Postgres returns them in the session's zone, converted back here.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    @property
    def python_type(self) -> type[datetime]:
        # TypeDecorator does not pass its impl's on; page cursors decode by it (api/pagination.py).
        return datetime

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous; pass an aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Node(Base):
    """A data-plane node as last registered / heard from."""

    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    region: Mapped[str] = mapped_column(String(80), index=True)
    provider: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(String(2048))
    models: Mapped[list[str]] = mapped_column(JSON)
    engine: Mapped[str] = mapped_column(String(16))
    version: Mapped[str] = mapped_column(String(64))
    # A meridian.contracts.NodeStatus value; a plain string keeps both backends alike.
    # Not indexed: nearly every node has one status, and an index here is what a renewal's
    # prepared statement, planned on a small table, kept reading (migration 0013).
    status: Mapped[str] = mapped_column(String(16))
    load: Mapped[dict[str, Any]] = mapped_column(JSON)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Not indexed: a heartbeat's renewal then rewrites no index entry (a HOT update, with the
    # table's fillfactor; migration 0013 says why and what it measured).
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime())
    # meridian.contracts.ColdStart of the node's last start, as it reported it.
    cold_start: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # ZMQ endpoints of the node's KV cache events and their replay, as it advertised them.
    kv_events: Mapped[str | None] = mapped_column(String(256), nullable=True)
    kv_events_replay: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # vLLM's --tool-call-parser of the node (None: it parses no tool calls), as it advertised it.
    tool_call_parser: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # meridian.contracts.NodeCapability values the node registered (NULL: an older agent,
    # which said none; routers then take its engine kind's, ENGINE_CAPABILITIES).
    capabilities: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # Sequences its engine runs at once (NodeRegistration.max_num_seqs; NULL: not said).
    max_num_seqs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Prefill/decode disaggregation: a meridian.contracts.NodeRole value and, for a prefill or
    # decode node, its meridian.contracts.KVTransferInfo (connector, endpoint, lease) as JSON.
    role: Mapped[str] = mapped_column(String(16), default="both", server_default="both")
    kv_transfer: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # control_plane.node_lease.report_digest of the models and cached weights the node last
    # reported (NULL until its first heartbeat after registering): a heartbeat that repeats
    # them only renews the lease.
    report_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)


class ApiKey(Base):
    """An API key; only its SHA-256 is stored. Its residency zone is its tenant's, stored
    there alone (migration 0014)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    scopes: Mapped[list[str]] = mapped_column(JSON)
    # None means every model.
    models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    # Flow control's priority band for this key's requests, overriding its tenant's (None: the
    # tenant's; meridian.contracts.Priority's range).
    priority: Mapped[int | None] = mapped_column(Integer, nullable=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Loaded with the keys, all of a query's at once (one more SELECT ... IN, not a join:
    # Postgres refuses FOR UPDATE on a key outer-joined to its tenant).
    tenant_row: Mapped[Tenant | None] = relationship(
        primaryjoin="foreign(ApiKey.tenant) == Tenant.name", viewonly=True, lazy="selectin")

    @property
    def zone(self) -> str | None:
        """The tenant's zone; None for a key whose tenant has no row: a deleted tenant's
        (revoked with it) or the bootstrap admin key's operator tenant, which serves no
        inference. Not guessed: a deleted tenant's key was not global."""
        return self.tenant_row.zone if self.tenant_row is not None else None


class RoutingState(Base):
    """The single row holding the routing table's version."""

    __tablename__ = "routing_state"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class Deployment(Base):
    """A model the fabric serves, where its replicas may run and how many it should have.

    `desired_replicas` is what the fabric is asked to run; actuators (the local scaler,
    later the reconciler and autoscaler) move the fleet towards it.
    """

    __tablename__ = "deployments"
    __table_args__ = (
        CheckConstraint("min_replicas >= 0", name="min_replicas_non_negative"),
        CheckConstraint("max_replicas >= 1", name="max_replicas_positive"),
        CheckConstraint("min_replicas <= max_replicas", name="min_le_max"),
        CheckConstraint("desired_replicas >= 0 AND desired_replicas <= max_replicas", name="desired_in_range"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), unique=True, index=True)
    zone: Mapped[str] = mapped_column(String(32))
    min_replicas: Mapped[int] = mapped_column(Integer)
    max_replicas: Mapped[int] = mapped_column(Integer)
    desired_replicas: Mapped[int] = mapped_column(Integer)
    last_scale_request_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_scale_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    last_scale_region: Mapped[str | None] = mapped_column(String(80), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Placement: demand per client region, spread, RTT objective, allowed SKUs, spot
    # (control_plane.api.deployments.PlacementSpec as JSON).
    placement: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Autoscaler (KPA): concurrency target, windows, scale-down delay, panic threshold
    # (control_plane.api.deployments.AutoscalingSpec as JSON).
    autoscaling: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Prefill/decode pools (meridian.contracts.DisaggregationSpec as JSON); None: co-located.
    # Then desired_replicas is the decode pool's count and desired_prefill_replicas the
    # prefill pool's (None while co-located).
    disaggregation: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    desired_prefill_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Optimistic concurrency: the ETag of the resource; bumped on every change.
    resource_version: Mapped[int] = mapped_column(Integer, default=1)


class WeightReplica(Base):
    """A node that holds (cached) or is downloading (fetching) a model's weights; peers
    of its region fetch from it. Rows go with their node."""

    __tablename__ = "weight_replicas"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    node_id: Mapped[str] = mapped_column(
        String(63), ForeignKey("nodes.node_id", ondelete="CASCADE"), primary_key=True, index=True
    )
    # "cached" or "fetching"
    state: Mapped[str] = mapped_column(String(16))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class RouterBacklogRow(Base):
    """Requests a router's flow control held for a (zone, model) pool at its last report
    (meridian.contracts.RouterBacklog). A report replaces the router's rows; rows older than
    the backlog TTL count for nothing and go with the next report of any router."""

    __tablename__ = "router_backlogs"

    router_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    zone: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    waiting: Mapped[int] = mapped_column(Integer)
    reported_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)


class ModelRecord(Base):
    """A model's architecture, as model fit needs it to size replicas per GPU SKU."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    params_b: Mapped[float] = mapped_column(Float)
    layers: Mapped[int] = mapped_column(Integer)
    kv_heads: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    # Weight format ("bf16", "fp8", "int4", "awq"… — control_plane.placement.fit) and the KV cache's.
    quantization: Mapped[str] = mapped_column(String(16))
    kv_cache_dtype: Mapped[str] = mapped_column(String(16))
    # Constrain the tensor-parallel degree and the all-reduce size when known.
    attention_heads: Mapped[int | None] = mapped_column(Integer, nullable=True)
    hidden_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_context: Mapped[int] = mapped_column(Integer)
    target_concurrent_seqs: Mapped[int] = mapped_column(Integer)
    weights_uri: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    resource_version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Capacity(Base):
    """How many GPUs of a SKU Meridian may run in a region (a cloud quota or an on-prem
    site's hosts). Placement never plans beyond it."""

    __tablename__ = "capacity"
    __table_args__ = (CheckConstraint("max_gpus >= 0", name="max_gpus_non_negative"),)

    region: Mapped[str] = mapped_column(String(80), primary_key=True)
    sku: Mapped[str] = mapped_column(String(32), primary_key=True)
    max_gpus: Mapped[int] = mapped_column(Integer)
    resource_version: Mapped[int] = mapped_column(Integer, default=1)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class PlacementPlan(Base):
    """A solved placement: previewed, then applied (the applied one is the current placement)."""

    __tablename__ = "placement_plans"
    # At most one plan in force: two concurrent applies cannot both succeed.
    __table_args__ = (
        Index(
            "uq_placement_plans_one_applied",
            "status",
            unique=True,
            sqlite_where=text("status = 'applied'"),
            postgresql_where=text("status = 'applied'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    # "preview" → "applied" → "superseded", or "preview" → "superseded" when a newer plan came
    # first (only the newest can be applied); "infeasible" plans are kept with their explanation.
    status: Mapped[str] = mapped_column(String(16), index=True)
    # The applied plan this one was solved against (its diff is relative to it).
    base_plan_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    cost_per_hour: Mapped[float | None] = mapped_column(Float, nullable=True)
    assignments: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    diff: Mapped[dict[str, Any]] = mapped_column(JSON)
    explanation: Mapped[str | None] = mapped_column(Text, nullable=True)
    solve_seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    created_by: Mapped[str] = mapped_column(String(200))
    applied_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    applied_by: Mapped[str | None] = mapped_column(String(200), nullable=True)


class Tenant(Base):
    """A customer of the fabric: its residency zone, allowed models, rate limits and flow
    control's priority and weight.

    Its zone is its API keys' too (they read it from here): changing it moves every key."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    zone: Mapped[str] = mapped_column(String(32))
    # None means every model.
    models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Tenants of one group share prefix-cache entries; None: the tenant's cache is its own.
    cache_group: Mapped[str | None] = mapped_column(String(100), nullable=True)
    # Flow control (issue 37): the tenant's priority band (larger is more urgent; below 0
    # sheddable) and its share of work within the band. Server defaults (migration 0017) so
    # that a control plane of an older version, writing neither, still inserts tenants.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    resource_version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AuditEntry(Base):
    """One change made through the admin API (or by the reconciler/autoscaler): who, what,
    the resource before and after. Written in the same transaction as the change."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    # The API key's id and name, or "system:<component>" for the control plane's own loops.
    actor_id: Mapped[str] = mapped_column(String(64))
    actor_name: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(32))
    resource_type: Mapped[str] = mapped_column(String(32), index=True)
    resource_id: Mapped[str] = mapped_column(String(256), index=True)
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Leadership(Base):
    """Who leads the control plane's fleet loops (reconciler, autoscaler), and the fencing epoch.

    On Postgres the leader is whoever holds a session-level advisory lock; this row only
    records it and carries `epoch`, which every acquisition increments and every write of
    the leader checks, so a deposed leader's late write is refused. On SQLite (one control
    plane) the row is a lease that expires at `expires_at`.
    """

    __tablename__ = "leadership"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    epoch: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime())
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # SQLite lease only; None on Postgres, where the lock dies with the leader's connection.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class NodeGroup(Base):
    """Nodes of one instance type in one region serving one deployment in one role, as the
    reconciler runs them through the provider's driver."""

    __tablename__ = "node_groups"
    __table_args__ = (
        UniqueConstraint("model", "region", "instance_type", "spot", "role", name="uq_node_groups_group_key"),
        CheckConstraint("desired_size >= 0 AND current_size >= 0", name="sizes_non_negative"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), index=True)
    provider: Mapped[str] = mapped_column(String(16))
    region: Mapped[str] = mapped_column(String(80))
    instance_type: Mapped[str] = mapped_column(String(64))
    sku: Mapped[str] = mapped_column(String(32))
    spot: Mapped[bool] = mapped_column(Boolean, default=False)
    # The nodes' prefill/decode role (a meridian.contracts.NodeRole value): a disaggregated
    # deployment has a prefill and a decode group where a co-located one has one "both" group.
    role: Mapped[str] = mapped_column(String(16), default="both", server_default="both")
    gpus_per_node: Mapped[int] = mapped_column(Integer)
    desired_size: Mapped[int] = mapped_column(Integer)
    current_size: Mapped[int] = mapped_column(Integer)
    # Node ids (= host / instance names) the driver reports in the group.
    nodes: Mapped[list[str]] = mapped_column(JSON)
    # "creating", "ready", "scaling", "draining", "deleting", "error"
    state: Mapped[str] = mapped_column(String(16))
    # Consecutive failed steps and when the next may be tried (exponential backoff).
    failures: Mapped[int] = mapped_column(Integer, default=0)
    retry_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    resource_version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class NodeDrain(Base):
    """A node the reconciler chose to remove: it stays draining (heartbeats cannot make it
    ready again) until the reconciler removes it or cancels the drain."""

    __tablename__ = "node_drains"

    node_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    node_group_id: Mapped[str] = mapped_column(String(36), index=True)
    requested_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ReconcileStep(Base):
    """One step the reconciler took on a node group, its outcome and its retry schedule."""

    __tablename__ = "reconcile_steps"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    node_group_id: Mapped[str] = mapped_column(String(36), index=True)
    model: Mapped[str] = mapped_column(String(200), index=True)
    # "create", "scale_up", "drain", "undrain", "scale_down", "delete"
    action: Mapped[str] = mapped_column(String(16))
    # The group size the step aims at.
    target: Mapped[int] = mapped_column(Integer)
    # "ok", "error" or "pending" (a drain waiting for in-flight requests)
    outcome: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer)
    detail: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    error: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The leadership epoch of the reconciler that took the step.
    epoch: Mapped[int] = mapped_column(BigInteger)


class AutoscalerDecision(Base):
    """One autoscaler decision for a deployment: its inputs, the count before and after, why."""

    __tablename__ = "autoscaler_decisions"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    # "stable" or "panic"
    mode: Mapped[str] = mapped_column(String(16))
    inputs: Mapped[dict[str, Any]] = mapped_column(JSON)
    current: Mapped[int] = mapped_column(Integer)
    desired: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(500))
    epoch: Mapped[int] = mapped_column(BigInteger)
