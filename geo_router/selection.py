"""Which replicas may serve a request, and in what order to try them.

Residency is a hard filter applied before any policy sees a candidate: a zoned tenant's
request never reaches a node outside its zone, even when that means answering 503.
Ordering is pluggable: a `RoutingPolicy` chosen by name from a small registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meridian.contracts import GLOBAL_ZONE, NodeStatus, RegionInfo, RoutingNode, TenantEntry
from meridian.geo import Point
from meridian.settings import RouterSettings

from .errors import ModelNotFound, NoHealthyReplica, NoReplicaInZone
from .health import FleetState
from .locate import region_rtt_ms
from .table import LoadedTable


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that may legally and usefully serve the request."""

    node: RoutingNode
    region: RegionInfo
    rtt_ms: float
    in_flight: int


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """What a policy may look at besides the candidates (prompt affinity uses `payload`)."""

    tenant: TenantEntry
    model: str
    stream: bool
    client_location: Point | None
    request_id: str
    payload: Mapping[str, Any] = field(default_factory=dict)


class RoutingPolicy(Protocol):
    """Orders candidates, best first. Must not add any: residency was already applied."""

    name: str

    def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]: ...


class NearestPolicy:
    """Nearest region first; within a region the least busy node (at this router), then id."""

    name = "nearest"

    def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.rtt_ms, c.in_flight, c.node.node_id))


PolicyFactory = Callable[[RouterSettings], RoutingPolicy]

_POLICIES: dict[str, PolicyFactory] = {"nearest": lambda _settings: NearestPolicy()}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy available to `RouterSettings.routing_policy` under `name`."""
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def create_policy(name: str, settings: RouterSettings) -> RoutingPolicy:
    """Build the policy registered under `name` (ValueError when there is none)."""
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {policy_names()}") from None
    return factory(settings)


def tenant_may_use(tenant: TenantEntry, region: RegionInfo) -> bool:
    """Residency: may this tenant's requests be served in `region`?"""
    return tenant.zone == GLOBAL_ZONE or tenant.zone in region.zones


def select_candidates(
    table: LoadedTable,
    tenant: TenantEntry,
    model: str,
    fleet: FleetState,
    client_location: Point | None,
) -> list[Candidate]:
    """Every usable replica for this tenant and model, unordered; typed errors when none."""
    if tenant.models is not None and model not in tenant.models:
        raise ModelNotFound(model)
    serving = [n for n in table.table.nodes if model in n.models]
    if not serving:
        raise ModelNotFound(model)
    out: list[Candidate] = []
    for node in serving:
        region = table.regions.get(node.region)
        # A node in a region the table does not describe has no known zone: never use it.
        if region is None or not tenant_may_use(tenant, region):
            continue
        if node.status != NodeStatus.READY or fleet.is_ejected(node.node_id):
            continue
        out.append(
            Candidate(
                node=node,
                region=region,
                rtt_ms=region_rtt_ms(client_location, region),
                in_flight=fleet.in_flight(node.node_id),
            )
        )
    if not out:
        raise exhausted_error(tenant, model)
    return out


def exhausted_error(tenant: TenantEntry, model: str) -> NoReplicaInZone | NoHealthyReplica:
    """The 503 to answer when no replica the tenant may use can serve `model`."""
    if tenant.zone == GLOBAL_ZONE:
        return NoHealthyReplica(model)
    return NoReplicaInZone(model, tenant.zone)


def models_for(table: LoadedTable, tenant: TenantEntry) -> list[str]:
    """Models the tenant may use that some ready node in its zone serves."""
    served: set[str] = set()
    for node in table.table.nodes:
        region = table.regions.get(node.region)
        if node.status == NodeStatus.READY and region is not None and tenant_may_use(tenant, region):
            served.update(node.models)
    if tenant.models is not None:
        served &= set(tenant.models)
    return sorted(served)
