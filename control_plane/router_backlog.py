"""Routers' flow-control backlogs: recorded per report, read by the autoscaler and the console.

Flow control (geo_router.admission.flow_control) holds the backlog at the routers, where the
nodes' heartbeats cannot show it; each router reports what it holds per (zone, model) pool
(meridian.contracts.RouterBacklog). A report replaces its router's rows in one transaction
(a reader sees the previous report or this one, never half of it). A row older than
`router_backlog_ttl_s` by the database's clock (control_plane.db.clock) is of a router that
stopped reporting and counts for nothing; such rows go with any router's next report, so
the table holds what live routers hold, bounded by routers x pools.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from control_plane.db.models import RouterBacklogRow
from meridian.contracts import RouterBacklog


@dataclass(frozen=True, slots=True)
class PoolHeld:
    """What every live router holds for one (zone, model) pool."""

    zone: str
    model: str
    waiting: int
    routers: int


def record(session: Session, router_id: str, report: RouterBacklog, now: datetime, ttl_s: float) -> None:
    """Replace `router_id`'s rows with `report` (a pool named twice counts the sum) and drop
    every router's rows past the TTL."""
    session.execute(delete(RouterBacklogRow).where(or_(
        RouterBacklogRow.router_id == router_id, RouterBacklogRow.reported_at < now - timedelta(seconds=ttl_s),
    )))
    waiting: Counter[tuple[str, str]] = Counter()
    for pool in report.pools:
        waiting[(pool.zone, pool.model)] += pool.waiting
    session.add_all(
        RouterBacklogRow(router_id=router_id, zone=zone, model=model, waiting=n, reported_at=now)
        for (zone, model), n in waiting.items() if n > 0
    )
    session.flush()


def held(session: Session, now: datetime, ttl_s: float) -> list[PoolHeld]:
    """Each pool's requests held by routers whose reports are fresh, by zone then model."""
    rows: Sequence[RouterBacklogRow] = session.scalars(
        select(RouterBacklogRow).where(RouterBacklogRow.reported_at >= now - timedelta(seconds=ttl_s))
    ).all()
    waiting: Counter[tuple[str, str]] = Counter()
    routers: Counter[tuple[str, str]] = Counter()
    for row in rows:
        waiting[(row.zone, row.model)] += row.waiting
        routers[(row.zone, row.model)] += 1
    return [PoolHeld(zone, model, waiting[(zone, model)], routers[(zone, model)]) for zone, model in sorted(waiting)]


def waiting_by_model(pools: Sequence[PoolHeld]) -> dict[str, int]:
    """Requests held per model, over the zones (a deployment is one model's, and a zone's
    routers hold requests only for a model some of its replicas serve: flow control holds
    nothing where a zone has no slots)."""
    out: Counter[str] = Counter()
    for pool in pools:
        out[pool.model] += pool.waiting
    return dict(out)
