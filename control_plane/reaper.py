"""Background task that expires nodes whose heartbeats stopped."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update

from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node, WeightReplica
from control_plane.routing_table import bump_version
from meridian.clock import event_or_timeout
from meridian.contracts import HEARTBEAT_RETRY_MAX_S, NodeStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReapResult:
    lost: tuple[str, ...]
    forgotten: tuple[str, ...]


def reap_once(ctx: AppContext, now: datetime | None = None) -> ReapResult:
    """Mark silent nodes lost (bumping the version) and forget long-lost ones, in one transaction.

    "Now" is the database's clock (control_plane.db.clock), as heartbeats are stamped with it,
    so a replica whose host clock is off neither expires healthy nodes nor keeps dead ones.
    """
    ttl = timedelta(seconds=ctx.settings.node_ttl_s)
    retention = timedelta(seconds=ctx.settings.lost_node_retention_s)
    with ctx.write() as session:
        now = now or db_now(session)
        lost = session.scalars(
            update(Node)
            .where(Node.status != NodeStatus.LOST.value, Node.last_heartbeat < now - ttl)
            .values(status=NodeStatus.LOST.value)
            .returning(Node.node_id)
            .execution_options(synchronize_session=False)
        ).all()
        if lost:
            bump_version(session)
        # A node becomes lost about ttl after its last heartbeat; keep it `retention` more.
        deleted = session.scalars(
            delete(Node)
            .where(Node.status == NodeStatus.LOST.value, Node.last_heartbeat < now - ttl - retention)
            .returning(Node.node_id)
            .execution_options(synchronize_session=False)
        ).all()
        if deleted:
            # Postgres cascades; SQLite does not enforce the foreign key.
            session.execute(delete(WeightReplica).where(WeightReplica.node_id.in_(deleted)))
    if lost:
        log.warning("nodes lost (no heartbeat for %.1fs): %s", ctx.settings.node_ttl_s, ", ".join(lost))
    if deleted:
        log.info("lost nodes forgotten: %s", ", ".join(deleted))
    return ReapResult(lost=tuple(lost), forgotten=tuple(deleted))


async def run_reaper(ctx: AppContext, stop: asyncio.Event) -> None:
    """Reap every reaper_interval_s until `stop` is set; errors are logged, not fatal.

    While the database is unreachable, or the control plane itself is down, no heartbeat
    can be recorded. So after start-up and after the database comes back, nodes get
    `reaper_grace_s` (a TTL plus their longest retry backoff) to prove they are alive before
    anyone is expired; otherwise every healthy node would be expired the moment the control
    plane came back from an outage longer than the TTL. Until then each pass only checks
    that the database still answers. The grace and the interval run on the app's clock.
    """
    settings, clock = ctx.settings, ctx.clock
    grace_s = settings.reaper_grace_s
    if grace_s is None:
        grace_s = settings.node_ttl_s + max(settings.heartbeat_interval_s, HEARTBEAT_RETRY_MAX_S)
    reachable_since: float | None = clock.monotonic()  # None: the last pass failed
    while not stop.is_set():
        if await event_or_timeout(clock, stop, settings.reaper_interval_s):
            return
        try:
            if reachable_since is not None and clock.monotonic() - reachable_since >= grace_s:
                await asyncio.to_thread(reap_once, ctx)
            else:
                await asyncio.to_thread(_ping, ctx)
                if reachable_since is None:
                    reachable_since = clock.monotonic()
                    log.warning("database reachable again; expiring no node for %.0fs", grace_s)
        except Exception:
            if reachable_since is not None:
                log.exception("reaper pass failed; no node is expired until the database has been back %.0fs",
                              grace_s)
            reachable_since = None


def _ping(ctx: AppContext) -> None:
    with ctx.read() as session:
        session.execute(select(1))
