"""Plan previews: what changes between the placement in force and a new one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from control_plane.placement.problem import Assignment


@dataclass(frozen=True, slots=True)
class PlanChange:
    """One deployment × region × instance type (× spot) whose instance count changes."""

    deployment: str
    region: str
    instance_type: str
    sku: str
    spot: bool
    instances_before: int
    instances_after: int
    replicas_before: int
    replicas_after: int
    cost_before: float
    cost_after: float

    @property
    def kind(self) -> str:
        """Kind of change: "added" (new here), "removed" (gone from here) or "changed" (count differs)."""
        if self.instances_before == 0:
            return "added"
        return "removed" if self.instances_after == 0 else "changed"


@dataclass(frozen=True, slots=True)
class PlanDiff:
    """Changes sorted by deployment, region, instance type; unchanged assignments are left out."""

    added: tuple[PlanChange, ...]
    removed: tuple[PlanChange, ...]
    changed: tuple[PlanChange, ...]

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)

    @property
    def cost_delta_per_hour(self) -> float:
        """New hourly cost minus old, over the changed assignments."""
        return sum(c.cost_after - c.cost_before for c in (*self.added, *self.removed, *self.changed))


def diff(current: Iterable[Assignment], new: Iterable[Assignment]) -> PlanDiff:
    """Added / removed / changed assignments per deployment-region-instance type from `current` to `new`."""
    zero = (0, 0, 0.0)
    before: dict[tuple[str, str, str, str, bool], tuple[int, int, float]] = defaultdict(lambda: zero)
    after: dict[tuple[str, str, str, str, bool], tuple[int, int, float]] = defaultdict(lambda: zero)
    for side, plan in ((before, current), (after, new)):
        for a in plan:
            i, r, c = side[a.key]
            side[a.key] = (i + a.instances, r + a.replicas, c + a.cost_per_hour)
    groups: dict[str, list[PlanChange]] = {"added": [], "removed": [], "changed": []}
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key, zero), after.get(key, zero)
        if b[:2] == a[:2]:
            continue
        deployment, region, instance_type, sku, spot = key
        change = PlanChange(deployment, region, instance_type, sku, spot, b[0], a[0], b[1], a[1], b[2], a[2])
        groups[change.kind].append(change)
    return PlanDiff(tuple(groups["added"]), tuple(groups["removed"]), tuple(groups["changed"]))


def churn_counts(current: Iterable[Assignment], new: Iterable[Assignment]) -> tuple[int, int]:
    """(replicas added, replicas removed) from `current` to `new`, per assignment key."""
    before: dict[tuple[str, str, str, str, bool], int] = defaultdict(int)
    after: dict[tuple[str, str, str, str, bool], int] = defaultdict(int)
    for a in current:
        before[a.key] += a.replicas
    for a in new:
        after[a.key] += a.replicas
    added = sum(max(0, after[k] - before.get(k, 0)) for k in after)
    removed = sum(max(0, before[k] - after.get(k, 0)) for k in before)
    return added, removed
