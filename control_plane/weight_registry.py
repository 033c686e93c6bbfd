"""Which nodes hold (or are fetching) which model weights, so a cold node fetches from a
same-region peer instead of the origin. The first node of a region to ask is sent to
the origin and recorded as fetching; the ones after it are sent to it."""

from __future__ import annotations

import zlib
from datetime import datetime

from sqlalchemy import delete, select, text, update
from sqlalchemy.orm import Session

from control_plane.db.models import Node, WeightReplica
from control_plane.errors import Forbidden, NotFound
from meridian import residency
from meridian.contracts import (
    NodeStatus,
    RegionInfo,
    WeightPeer,
    WeightSources,
    WeightSourcesRequest,
)

CACHED = "cached"
FETCHING = "fetching"


def _serialise_claims(session: Session, digest: str, region: str) -> None:
    """Make concurrent askers for one model in one region take turns (SQLite writers
    already do: they begin IMMEDIATE)."""
    if session.get_bind().dialect.name == "postgresql":
        key = zlib.crc32(f"{digest}/{region}".encode()) - 2**31
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})


def sources(
    session: Session, digest: str, req: WeightSourcesRequest, regions: dict[str, RegionInfo], now: datetime
) -> WeightSources:
    """Peers of the asking node's region for `digest`, cached ones first, then the earliest
    fetching one; records the asker as fetching. Forbidden when residency forbids it."""
    node = session.get(Node, req.node_id)
    if node is None or node.status == NodeStatus.LOST.value:
        raise NotFound(f"node {req.node_id!r} is not registered")
    region = regions[node.region]
    if not region.admits(req.zone):
        raise Forbidden(
            f"the model is bound to zone {req.zone!r}; node {node.node_id} is in {node.region} "
            f"(zones {', '.join(region.zones)})"
        )
    if req.origin_region is not None:
        origin = regions.get(req.origin_region)  # one the fabric does not know has no zone
        if not residency.admits(origin.zones if origin is not None else (), req.zone):
            raise Forbidden(f"the model is bound to zone {req.zone!r} but its origin is in {req.origin_region}")
    _serialise_claims(session, digest, node.region)
    rows = session.execute(
        select(WeightReplica, Node)
        .join(Node, Node.node_id == WeightReplica.node_id)
        .where(
            WeightReplica.digest == digest,
            Node.region == node.region,
            Node.node_id != node.node_id,
            Node.status != NodeStatus.LOST.value,
        )
    ).all()
    cached = sorted((n for r, n in rows if r.state == CACHED), key=lambda n: n.node_id)
    fetching = sorted(((r.updated_at, n) for r, n in rows if r.state == FETCHING), key=lambda t: (t[0], t[1].node_id))
    peers = [WeightPeer(node_id=n.node_id, url=n.url, state=CACHED) for n in cached]
    peers += [WeightPeer(node_id=n.node_id, url=n.url, state=FETCHING) for _, n in fetching]
    # A repeated ask keeps the original claim time: the first fetcher stays first.
    if session.get(WeightReplica, (digest, node.node_id)) is None:
        session.add(WeightReplica(digest=digest, node_id=node.node_id, state=FETCHING, updated_at=now))
    return WeightSources(peers=peers, node_zones=list(region.zones))


def withdraw(session: Session, digest: str, node_id: str) -> None:
    """The node no longer has (or will not finish) this model."""
    session.execute(delete(WeightReplica).where(WeightReplica.digest == digest, WeightReplica.node_id == node_id))
    # The node's next heartbeat syncs its cached set again, whatever it reports
    # (control_plane.node_lease renews only a report the rows still match).
    session.execute(update(Node).where(Node.node_id == node_id).values(report_digest=None))


def sync_cached(session: Session, node_id: str, digests: list[str], now: datetime) -> None:
    """Make the node's cached set exactly `digests` (from a heartbeat); fetching claims of
    other models are left alone."""
    current = {r.digest: r for r in session.scalars(select(WeightReplica).where(WeightReplica.node_id == node_id))}
    wanted = set(digests)
    for digest, row in current.items():
        if digest in wanted:
            if row.state != CACHED:
                row.state, row.updated_at = CACHED, now
        elif row.state == CACHED:
            session.delete(row)
    for digest in wanted - current.keys():
        session.add(WeightReplica(digest=digest, node_id=node_id, state=CACHED, updated_at=now))


def forget_node(session: Session, node_id: str) -> None:
    session.execute(delete(WeightReplica).where(WeightReplica.node_id == node_id))


def cached_digests(session: Session, node_id: str) -> list[str]:
    return sorted(session.scalars(
        select(WeightReplica.digest).where(WeightReplica.node_id == node_id, WeightReplica.state == CACHED)
    ))
