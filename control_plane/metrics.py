"""The control plane's Prometheus metrics, in a registry owned by one app.

Counters are incremented where the work happens: `observe_reconciler` and
`observe_autoscaler` wrap the fleet loops' passes (control_plane.fleet), and `observe_reaper`
is handed each reaper pass's report, so the loops themselves stay free of metrics code. Gauges describe the fleet as the
database has it and are read at scrape time (`render`), in a worker thread: who leads
(this replica's elector), the plan in force, the routing-table version, the registered
nodes by region and status.

`/metrics` (control_plane.api.metrics) answers a bearer of the `metrics_token`, the cluster
token or an API key with a fleet-reading scope: it names regions and the plan in force.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.autoscaler import Decision
from control_plane.db.models import Node
from control_plane.leader import Deposed, Fence
from control_plane.planner import current_plan
from control_plane.reaper import Hold, PassKind, PassReport
from control_plane.reconciler import StepResult
from control_plane.routing_table import current_version

ReconcileTick = Callable[[Fence], Awaitable[list[StepResult]]]
AutoscaleTick = Callable[[Fence], Awaitable[list[tuple[str, Decision]]]]


class Leading(Protocol):
    @property
    def is_leader(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the gauges show, read from the database in one session."""

    plan_id: str | None
    routing_version: int
    nodes: dict[tuple[str, str], int]  # (region, status) -> count

    @classmethod
    def read(cls, session: Session) -> FleetView:
        plan = current_plan(session)
        rows = session.execute(select(Node.region, Node.status, func.count()).group_by(Node.region, Node.status))
        return cls(
            plan_id=plan.id if plan is not None else None,
            routing_version=current_version(session),
            nodes={(region, status): count for region, status, count in rows},
        )


def direction(decision: Decision) -> str:
    """up, down or hold: the decision against the replica count in force when it was made."""
    current = decision.inputs.get("current")
    if not isinstance(current, int) or decision.desired == current:
        return "hold"
    return "up" if decision.desired > current else "down"


class ControlPlaneMetrics:
    """Counters of the fleet loops and gauges of the fleet, for one control-plane app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.reconciler_steps = Counter(
            "meridian_cp_reconciler_steps", "Reconciler steps taken, by action and outcome.",
            ("action", "outcome"), registry=reg)
        self.reconciler_passes = Counter(
            "meridian_cp_reconciler_passes", "Reconciler passes of this replica while it led, by result "
            "(error: the pass itself failed and is retried with backoff).", ("result",), registry=reg)
        for result in ("ok", "error"):
            self.reconciler_passes.labels(result)
        self.autoscaler_decisions = Counter(
            "meridian_cp_autoscaler_decisions", "Autoscaler decisions of this replica, by deployment and "
            "direction (up, down, hold).", ("deployment", "direction"), registry=reg)
        self.leader = Gauge("meridian_cp_leader", "1 on the replica that leads the fleet loops, else 0.",
                            registry=reg)
        self.plan_in_force = Gauge("meridian_cp_plan_in_force_info", "The applied placement plan (value 1).",
                                   ("plan_id",), registry=reg)
        self.routing_version = Gauge("meridian_cp_routing_table_version",
                                     "Version of the routing table the control plane serves.", registry=reg)
        self.nodes = Gauge("meridian_cp_nodes", "Registered nodes by region and status.", ("region", "status"),
                           registry=reg)
        self.reaper_passes = Counter(
            "meridian_cp_reaper_passes", "Reaper passes of this replica, by kind (reaped, held: silent nodes "
            "kept because the control plane is the likelier cause, grace: after start-up, a database outage "
            "or a stall of this control plane, failed).", ("kind",), registry=reg)
        for kind in PassKind:
            self.reaper_passes.labels(kind.value)
        self.reaper_expired = Counter(
            "meridian_cp_reaper_expired_nodes", "Nodes this replica's reaper marked lost.", registry=reg)
        self.reaper_holding = Gauge(
            "meridian_cp_reaper_holding", "1 while this replica's reaper expires no silent node because "
            "heartbeat processing is behind or the fleet fell silent at once (reason), else 0.",
            ("reason",), registry=reg)
        for hold in Hold:
            self.reaper_holding.labels(hold.value).set(0)
        self.reaper_deferred = Gauge(
            "meridian_cp_reaper_deferred_nodes", "Nodes silent past the TTL that the last reaper pass left "
            "for later (held, or beyond the per-region share expired per pass).", registry=reg)
        # Gauges are cleared and refilled per scrape: concurrent scrapes take turns.
        self._lock = threading.Lock()

    def observe_reconciler(self, tick: ReconcileTick) -> ReconcileTick:
        """`tick`, counting its passes and the steps each took."""

        async def counted(fence: Fence) -> list[StepResult]:
            try:
                results = await tick(fence)
            except Deposed:
                raise  # not a failure: another replica leads now
            except Exception:
                self.reconciler_passes.labels("error").inc()
                raise
            self.reconciler_passes.labels("ok").inc()
            for r in results:
                self.reconciler_steps.labels(r.action.value, r.outcome.value).inc()
            return results

        return counted

    def observe_autoscaler(self, tick: AutoscaleTick) -> AutoscaleTick:
        """`tick`, counting each deployment's decision by direction."""

        async def counted(fence: Fence) -> list[tuple[str, Decision]]:
            decisions = await tick(fence)
            for model, decision in decisions:
                self.autoscaler_decisions.labels(model, direction(decision)).inc()
            return decisions

        return counted

    def observe_reaper(self, report: PassReport) -> None:
        """Count one reaper pass; the hold and deferred gauges show the last one."""
        self.reaper_passes.labels(report.kind.value).inc()
        self.reaper_expired.inc(report.lost)
        for hold in Hold:
            self.reaper_holding.labels(hold.value).set(1 if report.hold is hold else 0)
        self.reaper_deferred.set(report.deferred)

    def render(self, view: FleetView, elector: Leading | None) -> bytes:
        """The exposition, gauges set from `view` and `elector` (None: loops disabled)."""
        with self._lock:
            self.leader.set(1 if elector is not None and elector.is_leader else 0)
            self.routing_version.set(view.routing_version)
            self.plan_in_force.clear()
            if view.plan_id is not None:
                self.plan_in_force.labels(view.plan_id).set(1)
            self.nodes.clear()
            for (region, status), count in view.nodes.items():
                self.nodes.labels(region, status).set(count)
            return generate_latest(self.registry)
