"""Which replicas may serve a request.

Residency is a hard filter applied before any policy sees a candidate: a zoned tenant's
request never reaches a node outside its zone, even when that means answering 503.
Ordering is the business of a `RoutingPolicy` (geo_router.policies).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from meridian.contracts import GLOBAL_ZONE, NodeStatus, RegionInfo, RoutingNode, TenantEntry
from meridian.geo import Point

from .errors import ModelNotFound, NoHealthyReplica, NoReplicaInZone
from .health import FleetState
from .locate import region_rtt_ms
from .table import LoadedTable

# A client told to come back after a replica's ejection is not told to wait more than this.
_MAX_RETRY_AFTER_S = 30


class LoraState(StrEnum):
    """Where a replica stands with the LoRA adapter a request asks for."""

    LOADED = "loaded"
    FREE_SLOT = "free_slot"
    NONE = "none"
    NOT_REQUESTED = "not_requested"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that may legally and usefully serve the request, and what the router knows of it.

    `in_flight` is this router's own count; `running`/`waiting`/`kv_usage` are what the node
    last reported (all routers' requests); `prefix_hit` is the share of the prompt's KV
    blocks the node is believed to hold; `queue_ms` estimates how long a request would wait
    there before its prefill starts; `recent` counts what this router sent there lately.
    """

    node: RoutingNode
    region: RegionInfo
    rtt_ms: float
    in_flight: int
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_hit: float = 0.0
    lora: LoraState = LoraState.NOT_REQUESTED
    queue_ms: float = 0.0
    # Requests this router sent there lately (exponentially decayed): the balance signal
    # that still works when requests come one at a time and nothing is ever pending.
    recent: float = 0.0

    @property
    def pending(self) -> int:
        """Requests at the node: the fresher of this router's count and the node's report."""
        return max(self.in_flight, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """What a policy may look at besides the candidates (prompt affinity uses `payload`)."""

    tenant: TenantEntry
    model: str
    stream: bool
    client_location: Point | None
    request_id: str
    payload: Mapping[str, Any] = field(default_factory=dict)


def split_adapter(model: str) -> tuple[str, str | None]:
    """(base model, LoRA adapter or None) of a requested model name such as `llama:sql`."""
    base, sep, adapter = model.partition(":")
    if sep and base and adapter:
        return base, adapter
    return model, None


def tenant_may_use(tenant: TenantEntry, region: RegionInfo) -> bool:
    """Residency: may this tenant's requests be served in `region`?"""
    return region.admits(tenant.zone)


def select_candidates(
    table: LoadedTable,
    tenant: TenantEntry,
    model: str,
    fleet: FleetState,
    client_location: Point | None,
    *,
    rtt: Callable[[Point | None, RegionInfo], float] = region_rtt_ms,
    allows: Callable[[str], bool] | None = None,
) -> list[Candidate]:
    """Every usable replica for this tenant and model, unordered; typed errors when none.

    `rtt` estimates client-to-region round trips; `allows` is a circuit breaker: a node it
    refuses (too many requests pending there) is left out like an ejected one.
    """
    base, _adapter = split_adapter(model)
    if not tenant.may_use(model):
        raise ModelNotFound(model)
    serving = [n for n in table.table.nodes if model in n.models]
    if not serving and base != model:
        # A LoRA adapter (`base:adapter`, as nodes name them) runs on its base model's nodes.
        serving = [n for n in table.table.nodes if base in n.models]
    if not serving:
        raise ModelNotFound(model)
    out: list[Candidate] = []
    # How soon an ejected replica the tenant could use is tried again (the 503's Retry-After).
    back_in_s = math.inf
    for node in serving:
        region = table.regions.get(node.region)
        # A node in a region the table does not describe has no known zone: never use it.
        if region is None or not tenant_may_use(tenant, region) or node.status != NodeStatus.READY:
            continue
        if fleet.is_ejected(node.node_id):
            back_in_s = min(back_in_s, fleet.ejected_for_s(node.node_id))
            continue
        if allows is not None and not allows(node.node_id):
            continue
        out.append(
            Candidate(
                node=node,
                region=region,
                rtt_ms=rtt(client_location, region),
                in_flight=fleet.in_flight(node.node_id),
            )
        )
    if not out:
        retry_after_s = 1 if math.isinf(back_in_s) else min(_MAX_RETRY_AFTER_S, math.ceil(back_in_s))
        raise exhausted_error(tenant, model, retry_after_s)
    return out


def exhausted_error(tenant: TenantEntry, model: str, retry_after_s: int = 1) -> NoReplicaInZone | NoHealthyReplica:
    """The 503 to answer when no replica the tenant may use can serve `model`."""
    if tenant.zone == GLOBAL_ZONE:
        return NoHealthyReplica(model, retry_after_s)
    return NoReplicaInZone(model, tenant.zone, retry_after_s)


def models_for(table: LoadedTable, tenant: TenantEntry) -> list[str]:
    """Models the tenant may use that some ready node in its zone serves."""
    served: set[str] = set()
    for node in table.table.nodes:
        region = table.regions.get(node.region)
        if node.status == NodeStatus.READY and region is not None and tenant_may_use(tenant, region):
            served.update(node.models)
    return sorted(m for m in served if tenant.may_use(m))


def zone_ready_replicas(table: LoadedTable) -> dict[tuple[str, str], int]:
    """Ready replicas per (zone, model) of each deployment that keeps replicas (min_replicas
    >= 1), for each zone whose tenants may use it and where it may run: the ready nodes of its
    model that the zone's tenants may use (as `select_candidates` counts them). A 0 is a zone
    whose requests are answered 503 no_replica_in_zone (the alert MeridianZoneWithoutReplica);
    a scale-from-zero deployment at 0 is only idle, so it is not listed.
    """
    ready: dict[tuple[str, str], int] = {}  # (model, region) -> ready nodes
    for node in table.table.nodes:
        if node.status == NodeStatus.READY:
            for model in node.models:
                ready[(model, node.region)] = ready.get((model, node.region), 0) + 1
    out: dict[tuple[str, str], int] = {}
    for d in table.deployments.values():
        if d.min_replicas < 1:
            continue
        for zone in {t.zone for t in table.tenants.values() if t.may_use(d.model)}:
            regions = [r for r in table.regions.values() if r.admits(zone)]
            # A deployment that may run in none of them can never serve this zone: nothing to alert on.
            if any(r.admits(d.zone) for r in regions):
                out[(zone, d.model)] = sum(ready.get((d.model, r.name), 0) for r in regions)
    return out
