"""Residency: the one rule that decides where a zone's data may be, asked by every layer.

"EU data stays in the EU" is what the fabric promises, so the question "may data of zone Z
be in region R" has one answer, written once, here: a region admits the zones it belongs to
and `global` (data that may be anywhere). Every layer asks this module, never a copy of its
rule: placement (which regions a deployment's replicas may use), the infrastructure plan
(which groups it may provision), routing (which replicas a tenant's request may reach, and
so where a stream may move and which prefill/decode pair may serve it), scale-from-zero,
the weight registry (which peers and origins a node may fetch weights from) and the node's
own check of its answer, tenants' and keys' zones (which zones exist), and the chaos
checker (what a drill counts as a violation).

Callers import the module and call `residency.admits(...)` (not `from ... import admits`):
the cross-layer property test swaps the rule for another and checks that every layer
follows it, which a call site with its own copy of the rule would not.

A tenant's zone is the tenant's alone (control_plane.db.models.Tenant); its keys and the
routing table's entries take it from there.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

# Data of the global zone may be anywhere; a tenant or deployment is global unless zoned.
GLOBAL_ZONE = "global"


class Zoned(Protocol):
    """A region as any layer describes it: the residency zones it belongs to."""

    @property
    def zones(self) -> Sequence[str]: ...


def admits(region_zones: Collection[str], zone: str) -> bool:
    """Whether a region belonging to `region_zones` may hold data of `zone`: serve a tenant
    of it, host a replica or weights of a deployment bound to it."""
    return zone == GLOBAL_ZONE or zone in region_zones


def is_bound(zone: str) -> bool:
    """Whether data of `zone` must stay in some regions: one whose zones are not known (a
    node that cannot reach the control plane) may not hold it."""
    return not admits((), zone)


def known_zones(regions: Iterable[Zoned]) -> set[str]:
    """The zones a tenant or deployment may be bound to: those whose data some region may
    hold (each region's own, and global). With no regions described, global alone."""
    listed = list(regions)
    if not listed:
        return {GLOBAL_ZONE}
    names = {GLOBAL_ZONE, *(zone for region in listed for zone in region.zones)}
    return {zone for zone in names if any(admits(region.zones, zone) for region in listed)}
