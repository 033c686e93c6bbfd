"""The local scaler's decision, pure: which nodes to start, in which role and region, for a
deployment that wants more than it runs.

A co-located deployment wants `desired_replicas` nodes, counting every live node of its model
in a region its zone admits (a node elsewhere serves other zones' tenants, never this
deployment's: counted, an eu deployment whose eu node died was never given another).
A disaggregated one (`DeploymentView.disaggregation`) wants two pools, each counted by its own
nodes: `desired_prefill_replicas` prefill nodes (its minimum while the control plane has set
none) and `desired_replicas` decode nodes (a disaggregated deployment's desired_replicas
counts its decode pool). The local scaler only starts nodes: stopping them is the reconciler's
job, as in production, and this fabric runs no reconciler.

Where: a prefill or decode node goes to a region where the other pool already runs (or is
being started), since KV moves only inside a region; otherwise, and for a co-located node, to
the region of the last scale-up request when the zone allows it, else to the first region the
zone allows (the fabric's own regions first). A local process can stand in any region.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meridian.contracts import DeploymentView, NodeRole, RegionInfo

_PARTNER = {NodeRole.PREFILL: NodeRole.DECODE, NodeRole.DECODE: NodeRole.PREFILL}


@dataclass(frozen=True, slots=True)
class LocalNode:
    """A live node of the deployment, or one to start: its role and region."""

    role: NodeRole
    region: str


def pool_targets(d: DeploymentView) -> dict[NodeRole, int]:
    """How many nodes of each role the deployment wants now."""
    if d.disaggregation is None:
        return {NodeRole.BOTH: d.desired_replicas}
    prefill = d.desired_prefill_replicas
    if prefill is None:
        prefill = d.disaggregation.min_prefill_replicas
    return {NodeRole.PREFILL: prefill, NodeRole.DECODE: d.desired_replicas}


def nodes_to_start(
    d: DeploymentView, running: Sequence[LocalNode], regions: Sequence[RegionInfo], own_regions: Sequence[str] = ()
) -> list[LocalNode] | None:
    """The nodes to start so that each pool reaches its target (prefill first); None when some
    are wanted but no region suits the deployment's zone."""
    allowed = {r.name for r in regions if r.admits(d.zone)}
    running = [n for n in running if n.region in allowed]
    ordered = [*own_regions, *sorted(allowed)]
    default = d.last_scale_region if d.last_scale_region in allowed else next(
        (name for name in ordered if name in allowed), None
    )
    planned: list[LocalNode] = []
    for role, target in pool_targets(d).items():
        # A co-located deployment counts every node of its model, whatever its role (as before P/D).
        have = len(running) if role is NodeRole.BOTH else sum(1 for n in running if n.role is role)
        for _ in range(target - have):
            region = _partner_region(role, [*running, *planned], allowed) or default
            if region is None:
                return None
            planned.append(LocalNode(role, region))
    return planned


def _partner_region(role: NodeRole, nodes: Sequence[LocalNode], allowed: set[str]) -> str | None:
    """The region of the first node of the other pool (then of this pool) in an allowed region."""
    partner = _PARTNER.get(role)
    if partner is None:
        return None
    for wanted in (partner, role):
        for n in nodes:
            if n.role is wanted and n.region in allowed:
                return n.region
    return None
