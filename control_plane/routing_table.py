"""The versioned routing table: building a snapshot and bumping its version."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane.db.models import ApiKey, Deployment, Node, RoutingState, Tenant
from control_plane.scopes import Scope
from meridian.contracts import (
    DeploymentEntry,
    KVTransferInfo,
    NodeRole,
    NodeStatus,
    RegionInfo,
    RoutingNode,
    RoutingTable,
    TenantEntry,
    intersect_models,
)

# Set on a session whose transaction bumped the version, so the caller can wake
# long-polls once it commits.
BUMPED = "meridian_routing_bumped"


def current_version(session: Session) -> int:
    """The routing version as this transaction sees it."""
    return session.execute(select(RoutingState.version).where(RoutingState.id == 1)).scalar_one()


def bump_version(session: Session) -> int:
    """Increment the routing version inside the caller's transaction; returns the new one."""
    # The UPDATE row-locks on Postgres, so concurrent bumps serialise and none is lost.
    session.execute(update(RoutingState).where(RoutingState.id == 1).values(version=RoutingState.version + 1))
    session.info[BUMPED] = True
    return current_version(session)


def build_routing_table(session: Session, regions: dict[str, RegionInfo], now: datetime) -> RoutingTable:
    """Snapshot of what routers need: regions, live nodes, inference keys and deployments,
    generated at `now`."""
    # Read the version first: under READ COMMITTED the rows read afterwards are at least
    # as new as it, so a snapshot is never labelled newer than its content.
    version = current_version(session)
    nodes = session.scalars(
        select(Node).where(Node.status != NodeStatus.LOST.value).order_by(Node.node_id)
    ).all()
    keys = session.scalars(
        select(ApiKey).where(ApiKey.revoked_at.is_(None)).order_by(ApiKey.created_at, ApiKey.id)
    ).all()
    deployments = session.scalars(select(Deployment).order_by(Deployment.model)).all()
    tenants = {t.name: t for t in session.scalars(select(Tenant)).all()}
    return RoutingTable(
        version=version,
        generated_at=now,
        regions=sorted(regions.values(), key=lambda r: r.name),
        nodes=[
            RoutingNode(
                node_id=n.node_id,
                region=n.region,
                url=n.url,
                models=list(n.models),
                status=NodeStatus(n.status),
                engine=n.engine,
                kv_events=n.kv_events,
                kv_events_replay=n.kv_events_replay,
                tool_call_parser=n.tool_call_parser,
                role=NodeRole(n.role),
                kv_transfer=node_kv_transfer(n),
            )
            for n in nodes
        ],
        tenants=[_tenant_entry(k, tenants.get(k.tenant)) for k in keys if Scope.INFERENCE.value in k.scopes],
        deployments=[
            DeploymentEntry(model=d.model, zone=d.zone, min_replicas=d.min_replicas, max_replicas=d.max_replicas)
            for d in deployments
        ],
    )


def node_kv_transfer(n: Node) -> KVTransferInfo | None:
    """The node's KV transfer as it registered it (None: co-located)."""
    return KVTransferInfo.model_validate(n.kv_transfer) if n.kv_transfer is not None else None


def _tenant_entry(key: ApiKey, tenant: Tenant | None) -> TenantEntry:
    models = intersect_models(key.models, tenant.models if tenant is not None else None)
    return TenantEntry(
        key_hash=key.key_hash,
        key_prefix=key.key_prefix,
        tenant=key.tenant,
        zone=key.zone,
        models=models,
        requests_per_minute=tenant.requests_per_minute if tenant is not None else None,
        tokens_per_minute=tenant.tokens_per_minute if tenant is not None else None,
        cache_group=tenant.cache_group if tenant is not None else None,
    )
