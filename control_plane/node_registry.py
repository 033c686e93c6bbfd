"""Nodes at rest: registration, heartbeats and deregistration.

A write here that changes what routers see marks its session (version_bumper.mark_changed)
rather than bumping the routing version inside its transaction: AppContext.write bumps after
the commit, one bump for all the node writes that committed meanwhile, so a registration storm
never queues on the version's row lock."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from control_plane import node_lease, weight_registry
from control_plane.db.models import Node, NodeDrain
from control_plane.errors import BadRequest, NotFound
from control_plane.routing_table import current_version, node_kv_transfer
from control_plane.version_bumper import mark_changed
from meridian.contracts import (
    ColdStart,
    NodeHeartbeat,
    NodeLoad,
    NodeRegistration,
    NodeRole,
    NodeStatus,
    NodeView,
    RegionInfo,
)


def _routing_fields(node: Node) -> tuple[object, ...]:
    """What routers see of a node; a change here is a new routing version."""
    return (node.region, node.url, tuple(node.models), node.engine, node.capabilities, node.status, node.kv_events,
            node.kv_events_replay, node.tool_call_parser, node.role, node.kv_transfer, node.max_num_seqs)


def _status(session: Session, node_id: str, reported: NodeStatus) -> str:
    """The node's status: as reported, except that a node the reconciler is removing stays
    draining (routers must not send it new requests)."""
    if reported == NodeStatus.DRAINING:
        return reported.value
    # No autoflush: a node being registered is in the session half-filled.
    with session.no_autoflush:
        draining = session.get(NodeDrain, node_id) is not None
    return NodeStatus.DRAINING.value if draining else reported.value


def register(session: Session, reg: NodeRegistration, regions: dict[str, RegionInfo], now: datetime) -> None:
    """Create or refresh a node (a restarted node registers again under the same id)."""
    region = regions.get(reg.region)
    if region is None:
        raise BadRequest(f"unknown region {reg.region!r}")
    if reg.status == NodeStatus.LOST:
        raise BadRequest("a node cannot register as lost")
    node = session.get(Node, reg.node_id, with_for_update=True)
    before = _routing_fields(node) if node is not None else None
    if node is None:
        node = Node(node_id=reg.node_id)
        session.add(node)
    node.region = reg.region
    node.provider = region.provider
    node.url = reg.url
    node.models = list(reg.models)
    node.engine = reg.engine.value
    node.capabilities = [c.value for c in reg.capabilities] if reg.capabilities is not None else None
    node.version = reg.version
    node.kv_events = reg.kv_events
    node.kv_events_replay = reg.kv_events_replay
    node.tool_call_parser = reg.tool_call_parser
    node.role = reg.role.value
    node.kv_transfer = reg.kv_transfer.model_dump(mode="json") if reg.kv_transfer is not None else None
    node.max_num_seqs = reg.max_num_seqs
    node.status = _status(session, reg.node_id, reg.status)
    node.load = NodeLoad(running=0, waiting=0, kv_cache_usage=0.0).model_dump()
    node.registered_at = now
    node.last_heartbeat = now
    # The first heartbeat after a registration takes the full path (it syncs the weights).
    node.report_digest = None
    session.flush()
    if _routing_fields(node) != before:
        mark_changed(session)


def heartbeat(session: Session, node_id: str, hb: NodeHeartbeat, now: datetime) -> int | None:
    """Record liveness and load; returns the routing version, or None when the heartbeat
    changed what routers see (the version is then the bump after the commit). NotFound if
    unknown or lost.

    An empty model list means "unchanged", so a heartbeat that omits it never pulls a
    node's models out of the table. This is the full path: a heartbeat that repeats the
    node's last report is cheaper through control_plane.node_lease.renew first.
    """
    if hb.status == NodeStatus.LOST:
        raise BadRequest("a node cannot report itself lost")
    # Row lock on Postgres: the reaper cannot mark the node lost under this heartbeat.
    node = session.get(Node, node_id, with_for_update=True)
    if node is None or node.status == NodeStatus.LOST.value:
        raise NotFound(f"node {node_id!r} is not registered; register again")
    before = _routing_fields(node)
    node.status = _status(session, node_id, hb.status)
    if hb.models:
        node.models = list(hb.models)
    node.load = hb.load.model_dump()
    if hb.cold_start is not None:
        node.cold_start = hb.cold_start.model_dump()
    node.last_heartbeat = now
    digest = node_lease.report_digest(node.models, hb.weights)
    if hb.weights is not None and digest != node.report_digest:
        # Only when the models or the weights differ from the last report: most status
        # changes (loading -> ready) leave the cached set as it was.
        weight_registry.sync_cached(session, node_id, hb.weights, now)
    node.report_digest = digest
    session.flush()
    if _routing_fields(node) != before:
        mark_changed(session)
        return None
    return current_version(session)


def deregister(session: Session, node_id: str) -> None:
    """Forget a node that finished draining (idempotent)."""
    node = session.get(Node, node_id, with_for_update=True)
    if node is None:
        return
    was_routed = node.status != NodeStatus.LOST.value
    weight_registry.forget_node(session, node_id)
    session.delete(node)
    session.flush()
    if was_routed:
        mark_changed(session)


def view(session: Session, n: Node) -> NodeView:
    """The node as the admin API and `meridian status` show it."""
    return NodeView(
        node_id=n.node_id,
        region=n.region,
        provider=n.provider,
        url=n.url,
        models=list(n.models),
        engine=n.engine,
        version=n.version,
        status=NodeStatus(n.status),
        load=NodeLoad.model_validate(n.load),
        registered_at=n.registered_at,
        last_heartbeat=n.last_heartbeat,
        cold_start=ColdStart.model_validate(n.cold_start) if n.cold_start else None,
        weights=weight_registry.cached_digests(session, n.node_id),
        role=NodeRole(n.role),
        kv_transfer=node_kv_transfer(n),
    )



def get(session: Session, node_id: str) -> NodeView:
    """The node with this id (lost ones included); NotFound when there is none."""
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound(f"no node {node_id!r}")
    return view(session, node)
