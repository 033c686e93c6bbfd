"""Background task that expires nodes whose heartbeats stopped, and never a healthy fleet.

Contract: a node silent for the TTL (by the database's clock) is marked lost and leaves the
routing table within a TTL plus one `reaper_interval_s`; silence the control plane caused
itself is not a node's death (static stability: a slow, paused or overloaded control plane
must not take healthy nodes out of service, as AWS's static-stability principle asks).

Silence the control plane causes, and what the reaper does about each:

- **It could not record heartbeats** (start-up, the database away, the control plane itself
  stalled: SIGSTOP, CPU starvation, a GC pause, a blocked event loop). For `reaper_grace_s`
  after it runs normally again (a TTL plus a node's longest retry backoff) nobody is expired.
  A stall is seen on the app's monotonic clock: a pass that starts more than
  `reaper_interval_s + reaper_stall_s` after the previous one did (or whose database read
  comes that late) restarts the grace, exactly as after a database outage.
- **It records heartbeats late** (requests queued in the accept backlog or the thread pool):
  the fleet looks silent all at once. The pass *holds* (expires nobody, warns once, sets
  `meridian_cp_reaper_holding`) while the newest heartbeat of any node is older than
  `reaper_heartbeats_behind_s` (nobody's heartbeat arrives: it is us), or while more than
  `reaper_max_silent_share` of the fleet is silent past the TTL at once. This is what
  Kubernetes' node lifecycle controller does when a zone is fully disrupted (it stops
  evicting). The holds need a fleet of `reaper_hold_min_nodes`: a lone node's death is
  reaped as before. The price: while a real mass death holds the reaper, the dead nodes stay
  in the table until an operator acts (the MeridianReaperHolding alert says so).
- **A region goes silent** (its network or the control plane's path to it): at most
  max(1, `reaper_region_share_per_pass` of the region's nodes, lost ones included) are
  expired per pass, longest-silent first, so a real region outage is still taken out, over
  1 / share passes (five by default: five seconds at the default interval).

Meanwhile the routers do not depend on the reaper to stop sending to a dead node: their
active probes (geo_router.state.probe: every READY node's /metrics each `probe_interval_s`,
`probe_unhealthy_threshold` failures in a row) and passive outlier detection (a connect
error ejects at once) eject it within seconds, bounded by `max_ejected_percent` of the
table, and a request that fails before its first byte is retried on another replica.

The decision (`decide`) is pure: it takes what a pass observed and returns what to expire
and why; the database reads and writes are at the edges (`reap_once`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node, WeightReplica
from control_plane.heartbeat_pacing import effective_ttl_s
from control_plane.routing_table import bump_version
from meridian.clock import event_or_timeout
from meridian.contracts import HEARTBEAT_RETRY_MAX_S, NodeStatus
from meridian.settings.control_plane import ControlPlaneSettings

log = logging.getLogger(__name__)


class Hold(StrEnum):
    """Why a pass expired nobody although nodes were silent past the TTL."""

    HEARTBEATS_BEHIND = "heartbeats_behind"  # no node's heartbeat recorded lately: the control plane lags
    FLEET_SILENT = "fleet_silent"  # too large a share of the fleet silent at once


class PassKind(StrEnum):
    """What one reaper pass did (the `kind` label of meridian_cp_reaper_passes_total)."""

    REAPED = "reaped"  # expiry ran (and may have found nobody to expire)
    HELD = "held"  # nodes were silent, the control plane's own lag is the likelier cause
    GRACE = "grace"  # within the grace after start-up, a database outage or a stall
    FAILED = "failed"  # the database did not answer


class GraceCause(StrEnum):
    """Why the grace (re)started: nobody could record heartbeats before."""

    START = "start"
    DATABASE = "database"
    STALL = "stall"


@dataclass(frozen=True, slots=True)
class ReapPolicy:
    """The reaper's settings, resolved (defaults filled in) once."""

    ttl: timedelta
    grace_s: float
    interval_s: float
    stall_s: float
    behind_after: timedelta
    max_silent_share: float
    hold_min_nodes: int
    region_share: float
    retention: timedelta

    @classmethod
    def from_settings(cls, s: ControlPlaneSettings, ttl_s: float | None = None) -> ReapPolicy:
        """`ttl_s`: the TTL nodes are held to now (control_plane.heartbeat_pacing: longer than
        node_ttl_s while a large fleet is told a longer interval); the grace and the
        heartbeats-behind hold scale with the interval that goes with it."""
        ttl_s = s.node_ttl_s if ttl_s is None else ttl_s
        heartbeat_s = s.heartbeat_interval_s * ttl_s / s.node_ttl_s
        grace_s = s.reaper_grace_s
        if grace_s is None:
            grace_s = ttl_s + max(heartbeat_s, HEARTBEAT_RETRY_MAX_S)
        behind_s = s.reaper_heartbeats_behind_s
        return cls(
            ttl=timedelta(seconds=ttl_s),
            grace_s=grace_s,
            interval_s=s.reaper_interval_s,
            stall_s=s.reaper_stall_s if s.reaper_stall_s is not None else s.heartbeat_interval_s,
            behind_after=timedelta(seconds=behind_s if behind_s is not None else 2 * heartbeat_s),
            max_silent_share=s.reaper_max_silent_share,
            hold_min_nodes=s.reaper_hold_min_nodes,
            region_share=s.reaper_region_share_per_pass,
            retention=timedelta(seconds=s.lost_node_retention_s),
        )

    def late(self, gap_s: float) -> bool:
        """Whether a pass `gap_s` after the previous one means the control plane stalled."""
        return gap_s > self.interval_s + self.stall_s


@dataclass(frozen=True, slots=True)
class SilentNode:
    node_id: str
    region: str
    last_heartbeat: datetime


@dataclass(frozen=True, slots=True)
class FleetObservation:
    """What a pass read: the database's now, and the nodes not lost."""

    now: datetime
    live: Mapping[str, int]  # nodes not lost, by region
    size: Mapping[str, int]  # every node the region has registered, lost ones too
    newest_heartbeat: datetime | None  # of those nodes
    silent: tuple[SilentNode, ...]  # those silent past the TTL, longest silent first

    @property
    def fleet(self) -> int:
        return sum(self.live.values())


@dataclass(frozen=True, slots=True)
class ReapDecision:
    expire: tuple[str, ...] = ()
    deferred: tuple[str, ...] = ()  # silent, left to later passes by the per-region cap
    hold: Hold | None = None


def decide(obs: FleetObservation, policy: ReapPolicy) -> ReapDecision:
    """Which silent nodes to expire now, which to leave for later passes, or why to hold."""
    if not obs.silent:
        return ReapDecision()
    hold = _hold(obs, policy)
    if hold is not None:
        return ReapDecision(deferred=tuple(n.node_id for n in obs.silent), hold=hold)
    expire: list[str] = []
    deferred: list[str] = []
    taken: dict[str, int] = {}
    for n in obs.silent:  # longest silent first
        cap = max(1, math.floor(policy.region_share * obs.size.get(n.region, 0)))
        if taken.get(n.region, 0) < cap:
            taken[n.region] = taken.get(n.region, 0) + 1
            expire.append(n.node_id)
        else:
            deferred.append(n.node_id)
    return ReapDecision(expire=tuple(expire), deferred=tuple(deferred))


def _hold(obs: FleetObservation, policy: ReapPolicy) -> Hold | None:
    if obs.fleet < policy.hold_min_nodes:
        return None
    if obs.newest_heartbeat is not None and obs.now - obs.newest_heartbeat > policy.behind_after:
        return Hold.HEARTBEATS_BEHIND
    if len(obs.silent) > policy.max_silent_share * obs.fleet:
        return Hold.FLEET_SILENT
    return None


@dataclass(frozen=True, slots=True)
class ReapResult:
    lost: tuple[str, ...]
    forgotten: tuple[str, ...]
    decision: ReapDecision = field(default_factory=ReapDecision)
    # The pass's database read came too late (the control plane stalled before it): nothing done.
    stalled: bool = False


def observe_fleet(session: Session, now: datetime, ttl: timedelta) -> FleetObservation:
    """The nodes not lost, by region, their newest heartbeat, and those silent past the TTL."""
    routed = Node.status != NodeStatus.LOST.value
    rows = session.execute(
        select(Node.region, func.count(), func.max(Node.last_heartbeat)).where(routed).group_by(Node.region)
    ).all()
    newest = [last for _, _, last in rows if last is not None]
    size = session.execute(select(Node.region, func.count()).group_by(Node.region)).all()
    silent = session.execute(
        select(Node.node_id, Node.region, Node.last_heartbeat)
        .where(routed, Node.last_heartbeat < now - ttl)
        .order_by(Node.last_heartbeat, Node.node_id)
    ).all()
    return FleetObservation(
        now=now,
        live={region: count for region, count, _ in rows},
        size={region: count for region, count in size},
        newest_heartbeat=max(newest) if newest else None,
        silent=tuple(SilentNode(node_id, region, last) for node_id, region, last in silent),
    )


def reap_once(ctx: AppContext, now: datetime | None = None, *, read_by: float | None = None) -> ReapResult:
    """Mark silent nodes lost as `decide` says (bumping the version) and forget long-lost
    ones, in one transaction.

    "Now" is the database's clock (control_plane.db.clock), as heartbeats are stamped with it,
    so a replica whose host clock is off neither expires healthy nodes nor keeps dead ones.
    `read_by` (the app's monotonic clock): if the database's now was read after it, the
    control plane stalled before the read (heartbeats went unrecorded meanwhile) and the pass
    does nothing. A stall after the read only makes "now" older, which expires fewer nodes.
    """
    # The configured TTL, or longer while the fleet is told a longer heartbeat interval.
    policy = ReapPolicy.from_settings(ctx.settings, ttl_s=effective_ttl_s(ctx))
    with ctx.write() as session:
        now = now or db_now(session)
        if read_by is not None and ctx.clock.monotonic() > read_by:
            return ReapResult(lost=(), forgotten=(), stalled=True)
        decision = decide(observe_fleet(session, now, policy.ttl), policy)
        lost: list[str] = []
        if decision.expire:
            # Still silent: a heartbeat recorded since the read keeps its node.
            lost = list(session.scalars(
                update(Node)
                .where(Node.node_id.in_(decision.expire), Node.status != NodeStatus.LOST.value,
                       Node.last_heartbeat < now - policy.ttl)
                .values(status=NodeStatus.LOST.value)
                .returning(Node.node_id)
                .execution_options(synchronize_session=False)
            ).all())
        if lost:
            bump_version(session)
        deleted = _forget(session, now - policy.ttl - policy.retention)
    if lost:
        log.warning("nodes lost (no heartbeat for %.1fs): %s", policy.ttl.total_seconds(), ", ".join(lost))
    if decision.deferred and decision.hold is None:
        log.warning("%d silent node(s) left for later passes (at most %.0f%% of a region per pass)",
                    len(decision.deferred), policy.region_share * 100)
    if deleted:
        log.info("lost nodes forgotten: %s", ", ".join(deleted))
    return ReapResult(lost=tuple(lost), forgotten=tuple(deleted), decision=decision)


def _forget(session: Session, before: datetime) -> list[str]:
    """Delete nodes lost since before `before` (a node becomes lost about a TTL after its
    last heartbeat, and is kept `retention` more); forgetting changes nothing routers see."""
    deleted = list(session.scalars(
        delete(Node)
        .where(Node.status == NodeStatus.LOST.value, Node.last_heartbeat < before)
        .returning(Node.node_id)
        .execution_options(synchronize_session=False)
    ).all())
    if deleted:
        # Postgres cascades; SQLite does not enforce the foreign key.
        session.execute(delete(WeightReplica).where(WeightReplica.node_id.in_(deleted)))
    return deleted


@dataclass(frozen=True, slots=True)
class PassReport:
    """One pass, as metrics see it."""

    kind: PassKind
    hold: Hold | None = None
    lost: int = 0
    deferred: int = 0


PassObserver = Callable[[PassReport], None]


def _ignore(report: PassReport) -> None:
    return None


@dataclass(slots=True)
class _Loop:
    """The loop's own state, on the app's monotonic clock."""

    policy: ReapPolicy
    last_start: float
    # When nodes may be expired again; None while the database does not answer.
    grace_until: float | None
    hold: Hold | None = None

    def restart_grace(self, now: float, cause: GraceCause, detail: str) -> None:
        self.grace_until = now + self.policy.grace_s
        log.warning("%s; expiring no node for %.0fs (grace after %s)", detail, self.policy.grace_s, cause.value)

    def held(self, hold: Hold | None) -> None:
        """Log a hold once when it begins and once when it ends."""
        if hold is not None and self.hold is None:
            log.warning("reaper holding (%s): nodes are silent, but the likelier cause is this control plane "
                        "falling behind on heartbeats; expiring none while it lasts", hold.value)
        elif hold is None and self.hold is not None:
            log.warning("reaper no longer holding (%s ended)", self.hold.value)
        self.hold = hold


async def run_reaper(ctx: AppContext, stop: asyncio.Event, observe: PassObserver = _ignore) -> None:
    """Reap every reaper_interval_s until `stop` is set; errors are logged, not fatal.

    After start-up, after the database comes back and after the control plane itself stalled,
    nodes get `reaper_grace_s` to prove they are alive before anyone is expired (see the
    module docstring); until then each pass only checks that the database still answers.
    The grace, the interval and the stall check run on the app's clock. `observe` gets a
    report of each pass (metrics).
    """
    clock = ctx.clock
    policy = ReapPolicy.from_settings(ctx.settings)
    state = _Loop(policy, last_start=clock.monotonic(), grace_until=clock.monotonic() + policy.grace_s)
    while not stop.is_set():
        if await event_or_timeout(clock, stop, policy.interval_s):
            return
        observe(await _pass(ctx, state))


async def _pass(ctx: AppContext, state: _Loop) -> PassReport:
    # The TTL (and so the grace) follows the interval the fleet is told (in memory: no I/O).
    state.policy = policy = ReapPolicy.from_settings(ctx.settings, ttl_s=ctx.pacer.reaper_ttl_s())
    clock = ctx.clock
    start = clock.monotonic()
    gap, state.last_start = start - state.last_start, start
    if policy.late(gap) and state.grace_until is not None:
        state.restart_grace(start, GraceCause.STALL, f"reaper pass {gap - policy.interval_s:.1f}s late: "
                                                     "the control plane stalled and heard no heartbeat")
    try:
        if state.grace_until is not None and start >= state.grace_until:
            result = await asyncio.to_thread(reap_once, ctx, read_by=start + policy.stall_s)
            if result.stalled:
                state.restart_grace(clock.monotonic(), GraceCause.STALL,
                                    "the reaper's database read came late: the control plane stalled")
                return PassReport(PassKind.GRACE)
            state.held(result.decision.hold)
            kind = PassKind.HELD if result.decision.hold is not None else PassKind.REAPED
            return PassReport(kind, result.decision.hold, len(result.lost), len(result.decision.deferred))
        await asyncio.to_thread(_ping, ctx)
        if state.grace_until is None:
            state.restart_grace(clock.monotonic(), GraceCause.DATABASE, "database reachable again")
        return PassReport(PassKind.GRACE)
    except Exception:
        if state.grace_until is not None:
            log.exception("reaper pass failed; no node is expired until the database has been back %.0fs",
                          policy.grace_s)
        state.grace_until = None
        return PassReport(PassKind.FAILED)


def _ping(ctx: AppContext) -> None:
    with ctx.read() as session:
        session.execute(select(1))
