"""The versioned routing table: building a snapshot and bumping its version."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Row, Text, cast, select, update
from sqlalchemy.orm import Session, lazyload

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
    # The UPDATE row-locks on Postgres, so concurrent bumps serialise and none is lost. The lock
    # is held to the commit, so the new version comes back in the same round trip (RETURNING)
    # rather than a second one under the lock: every bumping write queues on that row.
    version = session.execute(
        update(RoutingState)
        .where(RoutingState.id == 1)
        .values(version=RoutingState.version + 1)
        .returning(RoutingState.version)
        .execution_options(synchronize_session=False)
    ).scalar_one()
    session.info[BUMPED] = True
    return int(version)


# The columns of a node that its RoutingNode carries. The JSON ones come back as their text:
# decoding them was ~60 % of reading the rows at 10,000 nodes (17 of 28 ms on Postgres), and a
# node whose row did not change is not decoded at all (build_routing_table's `known`).
_ROUTED_COLUMNS = (
    Node.node_id, Node.region, Node.url, cast(Node.models, Text).label("models"), Node.status, Node.engine,
    cast(Node.capabilities, Text).label("capabilities"),
    Node.kv_events, Node.kv_events_replay, Node.tool_call_parser, Node.role,
    cast(Node.kv_transfer, Text).label("kv_transfer"), Node.max_num_seqs,
)


# A previous build's nodes by id, each with the row it was made from (see build_routing_table).
NodeRows = dict[str, tuple[Row[Any], RoutingNode]]


def build_routing_table(
    session: Session, regions: dict[str, RegionInfo], now: datetime, known: NodeRows | None = None
) -> RoutingTable:
    """Snapshot of what routers need: regions, live nodes, inference keys and deployments,
    generated at `now`.

    `known`: the nodes of the previous build with their rows; a node whose row is unchanged is
    that same object (not validated again: ~2/3 of a build at 10,000 nodes), and `known` is
    replaced by this build's once it succeeds.
    """
    # Read the version first: under READ COMMITTED the rows read afterwards are at least
    # as new as it, so a snapshot is never labelled newer than its content.
    version = current_version(session)
    # Only the columns the table carries, as rows rather than ORM objects: at 10,000 nodes
    # loading whole Node entities (load, timestamps, identity map) was ~3/4 of a build.
    # Ordered here rather than by the database: a collation (Postgres's en_US) may order ids
    # otherwise, and a router applying deltas orders them as Python does.
    nodes = sorted(
        session.connection().execute(select(*_ROUTED_COLUMNS).where(Node.status != NodeStatus.LOST.value)).all(),
        key=lambda n: n.node_id,
    )
    keys = session.scalars(  # their tenants are read whole below: no join per key
        select(ApiKey).options(lazyload(ApiKey.tenant_row)).where(ApiKey.revoked_at.is_(None))
        .order_by(ApiKey.created_at, ApiKey.id)
    ).all()
    deployments = session.scalars(select(Deployment).order_by(Deployment.model)).all()
    tenants = {t.name: t for t in session.scalars(select(Tenant)).all()}
    table = RoutingTable(
        version=version,
        generated_at=now,
        regions=sorted(regions.values(), key=lambda r: r.name),
        nodes=_routing_nodes(nodes, known),
        # A key whose tenant has no row has no residency zone: it is served nowhere.
        tenants=[_tenant_entry(k, tenants[k.tenant]) for k in keys
                 if Scope.INFERENCE.value in k.scopes and k.tenant in tenants],
        deployments=[
            DeploymentEntry(model=d.model, zone=d.zone, min_replicas=d.min_replicas, max_replicas=d.max_replicas)
            for d in deployments
        ],
    )
    if known is not None:
        known.clear()
        known.update((row.node_id, (row, node)) for row, node in zip(nodes, table.nodes, strict=True))
    return table


def _routing_nodes(rows: list[Row[Any]], known: NodeRows | None) -> list[RoutingNode]:
    out = []
    for n in rows:
        before = known.get(n.node_id) if known is not None else None
        if before is not None and before[0] == n:
            out.append(before[1])
            continue
        out.append(RoutingNode(
            node_id=n.node_id,
            region=n.region,
            url=n.url,
            models=json.loads(n.models),
            status=NodeStatus(n.status),
            engine=n.engine,
            capabilities=json.loads(n.capabilities) if n.capabilities is not None else None,
            kv_events=n.kv_events,
            kv_events_replay=n.kv_events_replay,
            tool_call_parser=n.tool_call_parser,
            role=NodeRole(n.role),
            kv_transfer=_kv_transfer(n.kv_transfer),
            max_num_seqs=n.max_num_seqs,
        ))
    return out


def _kv_transfer(text: str | None) -> KVTransferInfo | None:
    # JSON's null (SQLAlchemy stores None so unless told otherwise) or SQL's NULL: co-located.
    value = json.loads(text) if text is not None else None
    return KVTransferInfo.model_validate(value) if value is not None else None


def node_kv_transfer(n: Node) -> KVTransferInfo | None:
    """The node's KV transfer as it registered it (None: co-located)."""
    return KVTransferInfo.model_validate(n.kv_transfer) if n.kv_transfer is not None else None


def _tenant_entry(key: ApiKey, tenant: Tenant) -> TenantEntry:
    return TenantEntry(
        key_hash=key.key_hash,
        key_prefix=key.key_prefix,
        tenant=key.tenant,
        zone=tenant.zone,  # the tenant's alone: a key has no zone of its own
        models=intersect_models(key.models, tenant.models),
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        cache_group=tenant.cache_group,
        # A key's own band wins over its tenant's; the weight is the tenant's alone (a share
        # among tenants, which a key of the tenant cannot enlarge).
        priority=key.priority if key.priority is not None else tenant.priority,
        weight=tenant.weight,
    )
