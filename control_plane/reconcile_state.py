"""What the reconciler aims at and what it sees, as plain data and pure functions.

- its vocabulary: the steps it takes (`StepAction`), their outcomes (`StepOutcome`) and the
  states of a node group (`NodeGroupState`); the database stores their strings;
- the target: the applied placement plan's groups (`parse_assignments`) and the node count
  each needs for a deployment's desired replicas (`target_sizes`). A group is one role's:
  a disaggregated deployment's prefill groups are sized from `desired_prefill_replicas`, its
  decode groups from `desired_replicas` (which counts its decode pool), each pool spread over
  its own groups as a co-located deployment's replicas are (`deployment_targets`);
- the snapshot one tick reads (`read_snapshot`) and the choices made on it alone: which nodes
  to drain first (`choose_victims`), which drain marks are stale (`stale_drains`);
- how far the fleet is from the target (`reconciler_status`): per node group the nodes it
  should have against those its provider holds and the last error, and one word for the
  whole, which the admin API, `meridian reconciler` and the console show, so that a plan is
  called in force only once the providers hold what it asks for.

None of it touches a driver or writes; control_plane.reconciler takes the steps.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane import planner
from control_plane.db.models import Deployment, Node, NodeDrain, NodeGroup
from meridian.admin_api import NodeGroupProgress, ReconcilerState, ReconcilerStatus
from meridian.contracts import NodeRole, NodeStatus
from providers.driver import GroupSpec

log = logging.getLogger(__name__)

GroupKey = tuple[str, str, str, bool, str]  # model, region, instance type, spot, role (a NodeRole value)


class StepAction(StrEnum):
    """A step the reconciler takes on a node group (reconcile_steps.action, the audit action)."""

    CREATE = "create"
    SCALE_UP = "scale_up"
    DRAIN = "drain"
    SCALE_DOWN = "scale_down"
    UNDRAIN = "undrain"
    DELETE = "delete"


class StepOutcome(StrEnum):
    """How a step ended (reconcile_steps.outcome)."""

    OK = "ok"
    PENDING = "pending"  # started; a later tick finishes it (a drain)
    ERROR = "error"


class NodeGroupState(StrEnum):
    """Where a node group stands (node_groups.state)."""

    CREATING = "creating"
    READY = "ready"
    SCALING = "scaling"
    DRAINING = "draining"
    DELETING = "deleting"
    ERROR = "error"


# --- the target: the plan's shape, the autoscaler's count --------------------------------


@dataclass(frozen=True, slots=True)
class PlacedGroup:
    """One assignment of the applied plan: `instances` nodes giving `replicas` replicas."""

    model: str
    region: str
    instance_type: str
    sku: str
    spot: bool
    instances: int
    replicas: int
    role: NodeRole = NodeRole.BOTH

    @property
    def key(self) -> GroupKey:
        return (self.model, self.region, self.instance_type, self.spot, self.role.value)

    @property
    def provider(self) -> str:
        return self.region.split(":", 1)[0]

    @property
    def replicas_per_node(self) -> int:
        return max(1, round(self.replicas / self.instances)) if self.instances else max(1, self.replicas)


def parse_assignments(assignments: Iterable[Mapping[str, Any]]) -> list[PlacedGroup]:
    """The plan's assignments (control_plane.placement.problem.Assignment as JSON) as groups;
    assignments of one group (same place, machine and role) are summed. A row without a role
    (plans applied before P/D) is co-located; one with a role this version does not know is skipped."""
    merged: dict[GroupKey, PlacedGroup] = {}
    for data in assignments:
        try:
            a = planner.assignment_of(data)
        except (KeyError, TypeError):
            log.warning("applied plan has an assignment without deployment/region/instance_type: %s", data)
            continue
        try:
            role = NodeRole(a.role)
        except ValueError:
            log.warning("applied plan has an assignment with an unknown node role %r: %s", a.role, data)
            continue
        group = PlacedGroup(
            model=a.deployment, region=a.region, instance_type=a.instance_type, sku=a.sku,
            spot=a.spot, instances=a.instances, replicas=a.replicas, role=role,
        )
        if (old := merged.get(group.key)) is not None:
            group = replace(group, instances=old.instances + a.instances, replicas=old.replicas + a.replicas)
        merged[group.key] = group
    return list(merged.values())


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` in proportion to `weights` by largest remainder (ties: earlier first)."""
    if not weights:
        return []
    if total <= 0:
        return [0] * len(weights)
    weights = [max(0.0, w) for w in weights]
    whole = sum(weights)
    if whole == 0:
        weights, whole = [1.0] * len(weights), float(len(weights))
    quotas = [total * w / whole for w in weights]
    shares = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def spread_replicas(desired: int, groups: Sequence[PlacedGroup]) -> dict[GroupKey, int]:
    """Replicas per group: `desired` spread in proportion to the plan's replicas, every placed
    region keeping at least one while `desired` allows it."""
    if not groups:
        return {}
    by_region: dict[str, list[PlacedGroup]] = defaultdict(list)
    for g in groups:
        by_region[g.region].append(g)
    regions = sorted(by_region, key=lambda r: (-sum(g.replicas for g in by_region[r]), r))
    per_region = apportion(desired, [sum(g.replicas for g in by_region[r]) for r in regions])
    if desired >= len(regions):
        # Active-active: a region the plan placed never goes empty while there are enough replicas.
        for i, share in enumerate(per_region):
            if share == 0:
                donor = max(range(len(regions)), key=lambda j: (per_region[j], -j))
                per_region[donor] -= 1
                per_region[i] = 1
    out: dict[GroupKey, int] = {}
    for region, share in zip(regions, per_region, strict=True):
        members = sorted(by_region[region], key=lambda g: (-g.replicas, g.instance_type, g.spot))
        for g, n in zip(members, apportion(share, [g.replicas for g in members]), strict=True):
            out[g.key] = n
    return out


def target_sizes(desired: int, groups: Sequence[PlacedGroup]) -> dict[GroupKey, int]:
    """Nodes per group for `desired` replicas of one deployment placed as `groups`."""
    replicas = spread_replicas(desired, groups)
    by_key = {g.key: g for g in groups}
    return {key: math.ceil(n / by_key[key].replicas_per_node) for key, n in replicas.items()}


def deployment_targets(
    desired: int, desired_prefill: int | None, groups: Sequence[PlacedGroup]
) -> dict[GroupKey, int]:
    """Nodes per group of one deployment: each role's groups get their own pool's count, spread
    over them alone — co-located groups `desired`, decode groups `desired` (a disaggregated
    deployment's desired_replicas counts its decode pool), prefill groups `desired_prefill`
    (None, not yet set by the API or the autoscaler: the plan's own prefill replicas)."""
    by_role: dict[NodeRole, list[PlacedGroup]] = defaultdict(list)
    for g in groups:
        by_role[g.role].append(g)
    out: dict[GroupKey, int] = {}
    for role, members in by_role.items():
        if role is NodeRole.PREFILL:
            count = desired_prefill if desired_prefill is not None else sum(g.replicas for g in members)
        else:
            count = desired
        out.update(target_sizes(count, members))
    return out


# --- what one tick reads -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupRow:
    """A node group as the tick read it (plain data, safe across threads)."""

    id: str
    model: str
    provider: str
    region: str
    instance_type: str
    sku: str
    spot: bool
    desired_size: int
    current_size: int
    nodes: tuple[str, ...]
    state: NodeGroupState
    failures: int
    retry_at: datetime | None
    role: NodeRole = NodeRole.BOTH
    # The last failed step's error (None once a step succeeds) and when the row last changed,
    # which, while the error stands, is when the step failed.
    last_error: str | None = None
    updated_at: datetime | None = None

    @property
    def key(self) -> GroupKey:
        return (self.model, self.region, self.instance_type, self.spot, self.role.value)

    @property
    def spec(self) -> GroupSpec:
        return GroupSpec(
            group_id=self.id, model=self.model, provider=self.provider, region=self.region,
            instance_type=self.instance_type, sku=self.sku, spot=self.spot, role=self.role,
        )


@dataclass(frozen=True, slots=True)
class NodeSeen:
    status: str
    in_flight: int
    last_heartbeat: datetime


@dataclass(frozen=True, slots=True)
class Snapshot:
    placed: dict[GroupKey, PlacedGroup]
    targets: dict[GroupKey, int]
    groups: dict[GroupKey, GroupRow]
    # group id → node id → when the drain was asked for
    drains: dict[str, dict[str, datetime]]
    nodes: dict[str, NodeSeen]
    # The applied plan's id (None: no plan applied yet).
    plan_id: str | None = None


def group_row(g: NodeGroup) -> GroupRow:
    """A node group's row as plain data (its state column read as a NodeGroupState)."""
    return GroupRow(
        id=g.id, model=g.model, provider=g.provider, region=g.region, instance_type=g.instance_type, sku=g.sku,
        spot=g.spot, desired_size=g.desired_size, current_size=g.current_size, nodes=tuple(g.nodes or ()),
        state=NodeGroupState(g.state), failures=g.failures, retry_at=g.retry_at, role=NodeRole(g.role),
        last_error=g.last_error, updated_at=g.updated_at,
    )


def read_snapshot(session: Session) -> Snapshot:
    """The applied plan, desired counts, node groups, drains and nodes, in one read."""
    plan = planner.current_plan(session)
    desired = {d.model: (d.desired_replicas, d.desired_prefill_replicas) for d in session.scalars(select(Deployment))}
    placed_groups = [g for g in parse_assignments(plan.assignments if plan else []) if g.model in desired]
    by_model: dict[str, list[PlacedGroup]] = defaultdict(list)
    for g in placed_groups:
        by_model[g.model].append(g)
    targets: dict[GroupKey, int] = {}
    for model, groups in by_model.items():
        targets.update(deployment_targets(*desired[model], groups))
    rows = {row.key: row for row in map(group_row, session.scalars(select(NodeGroup)))}
    drains: dict[str, dict[str, datetime]] = defaultdict(dict)
    for d in session.scalars(select(NodeDrain)):
        drains[d.node_group_id][d.node_id] = d.requested_at
    nodes = {
        n.node_id: NodeSeen(
            status=n.status,
            in_flight=int((n.load or {}).get("running", 0)) + int((n.load or {}).get("waiting", 0)),
            last_heartbeat=n.last_heartbeat,
        )
        for n in session.scalars(select(Node))
    }
    return Snapshot(
        placed={g.key: g for g in placed_groups}, targets=targets, groups=rows, drains=dict(drains), nodes=nodes,
        plan_id=plan.id if plan else None,
    )



# --- pure choices on a snapshot ---------------------------------------------------------


def choose_victims(candidates: Sequence[str], nodes: Mapping[str, NodeSeen], count: int) -> list[str]:
    """The nodes to remove first: gone or lost, then not serving, then the least busy, then the newest."""
    order = {n: i for i, n in enumerate(candidates)}

    def cost(n: str) -> tuple[int, int, int]:
        seen = nodes.get(n)
        if seen is None or seen.status == NodeStatus.LOST.value:
            rank = 0
        elif seen.status != NodeStatus.READY.value:
            rank = 1
        else:
            rank = 2
        return (rank, seen.in_flight if seen else 0, -order[n])

    return sorted(candidates, key=cost)[:count]


def stale_drains(snap: Snapshot) -> list[str]:
    """Drain marks to drop: nodes no group holds any more, once their node is gone or lost."""
    held = {n for g in snap.groups.values() for n in g.nodes}
    return sorted(
        node_id for drains in snap.drains.values() for node_id in drains
        if node_id not in held and (node_id not in snap.nodes or snap.nodes[node_id].status == NodeStatus.LOST.value)
    )


def state_after(action: StepAction, outcome: StepOutcome, current: int, target: int) -> NodeGroupState:
    """A group's state after a step that did not fail."""
    if outcome is StepOutcome.PENDING or action is StepAction.DRAIN:
        return NodeGroupState.DRAINING
    if action is StepAction.DELETE:
        return NodeGroupState.DELETING
    return NodeGroupState.READY if current == target else NodeGroupState.SCALING


# --- how far the fleet is from the target -------------------------------------------------


def _progress(key: GroupKey, snap: Snapshot) -> NodeGroupProgress:
    """One group's desired nodes against those its provider holds (none before it is created)."""
    model, region, instance_type, spot, role = key
    row = snap.groups.get(key)
    group = row if row is not None else snap.placed[key]  # the row, or its placement before it exists
    where = {"model": model, "provider": group.provider, "region": region, "instance_type": instance_type,
             "spot": spot, "role": NodeRole(role), "sku": group.sku, "desired": snap.targets.get(key, 0)}
    if row is None:  # placed, not created yet
        return NodeGroupProgress(**where, group_id=None, actual=0, ready=0, state=None,
                                 failures=0, last_error=None, error_at=None, retry_at=None)
    ready = [n for n in row.nodes if n in snap.nodes and snap.nodes[n].status == NodeStatus.READY.value]
    return NodeGroupProgress(
        **where, group_id=row.id, actual=len(row.nodes), ready=len(ready), state=row.state.value,
        failures=row.failures, last_error=row.last_error, error_at=row.updated_at if row.last_error else None,
        retry_at=row.retry_at,
    )


def reconciler_status(snap: Snapshot) -> ReconcilerStatus:
    """The node groups the plan in force asks for (and those being removed), desired against
    actual, and the whole: failing when any group's last step failed, reconciling while any
    group's provider holds other than its target, in force otherwise."""
    keys = sorted({k for k, n in snap.targets.items() if n > 0} | set(snap.groups))
    groups = [_progress(k, snap) for k in keys]
    failing = [g for g in groups if g.last_error is not None]
    off_target = [g for g in groups if g.actual != g.desired]
    if snap.plan_id is None and not groups:
        state, summary = ReconcilerState.NO_PLAN, "no placement applied yet (meridian plan --apply)"
    elif failing:
        g = failing[0]
        more = f" (and {len(failing) - 1} more)" if len(failing) > 1 else ""
        state = ReconcilerState.FAILING
        summary = f"{g.model}@{g.region}/{g.instance_type}: {g.last_error}{more}"
    elif off_target:
        state = ReconcilerState.RECONCILING
        summary = (f"node groups at their target: {len(groups) - len(off_target)} of {len(groups)}"
                   f" (nodes: {sum(g.actual for g in groups)} of {sum(g.desired for g in groups)})")
    else:
        state = ReconcilerState.IN_FORCE
        summary = (f"every node group at its target ({_count(len(groups), 'group')},"
                   f" {_count(sum(g.actual for g in groups), 'node')})")
    return ReconcilerStatus(state=state, summary=summary, plan_id=snap.plan_id, groups=groups)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"
