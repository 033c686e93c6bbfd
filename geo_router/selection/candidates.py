"""Which replicas may serve a request.

Residency is a hard filter applied before any policy sees a candidate: a zoned tenant's
request never reaches a node outside its zone, even when that means answering 503.
Ejected nodes and nodes the circuit breaker refuses are left out too; when that leaves none,
the 503's Retry-After says when the first ejected one is tried again. Ordering is the
business of a `RoutingPolicy` (geo_router.selection.policies).

A bounded set (`limit`, RouterSettings.max_candidates): every candidate is annotated and
scored per request (geo_router.selection.affinity, the policy), at ~1 µs or more each, so a model with
thousands of replicas must not hand them all over (at 750 replicas, building them alone took
3.6 ms against a ~0.1 ms routing budget). With more usable replicas than `limit`, the set is
built as large-fleet schedulers build theirs (llm-d's filters, power-of-d-choices sampling):

- regions the tenant may use are grouped into tiers of equal RTT from the client (one tier
  when the client is unknown) and walked nearest first, O(regions), from the table's index
  model -> region -> READY nodes; whole tiers are taken while they fit in 3/4 of `limit`;
- the tier that does not fit gives a random draw up to that share (so a large nearest region
  spreads its load over all its replicas, request after request);
- the last quarter or more is a uniform draw over every replica not taken yet, further
  regions included: somewhere to spill to when the near ones queue past the latency
  objective, and to fail over to.

Draws are a lazy Fisher-Yates shuffle from `rng` (injectable for tests): each costs O(log
regions), and a drawn node that is ejected or refused is skipped for the next draw, so the
work is O(limit + regions) unless most replicas are unusable, and O(replicas) only when
none is (the 503, whose Retry-After then still sees every ejection). Below the bound, every
usable replica is a candidate, as before. Nodes the caller names in `also` (a stored
response's) join the set whatever the bound, after the same checks, and
`named_candidates` applies them to nodes named later (a prompt's holders, geo_router.selection.affinity).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from meridian import residency
from meridian.contracts import NodeStatus, RegionInfo, RoutingNode, TenantEntry
from meridian.geo import Point, region_rtt_ms

from ..errors import ModelNotFound, NoHealthyReplica, NoReplicaInZone
from ..state.health import FleetState
from ..state.table import LoadedTable

# A client told to come back after a replica's ejection is not told to wait more than this.
_MAX_RETRY_AFTER_S = 30
# Of a bounded candidate set, at least 1/this is a uniform sample of the replicas beyond the
# nearest ones: somewhere to spill and fail over to, and a share of the load for the rest.
_SAMPLE_SHARE = 4
# Draws for a bounded set when the caller brings no generator of its own.
_RNG = random.Random()


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


@dataclass(frozen=True, slots=True)
class FleetView:
    """What selection asks of the router's view of the fleet: health (ejections), the
    circuit breaker (`allows`: a node it refuses, with too many requests pending there, is
    left out like an ejected one) and client-to-region round trips (`rtt`)."""

    fleet: FleetState
    rtt: Callable[[Point | None, RegionInfo], float] = region_rtt_ms
    allows: Callable[[str], bool] | None = None


def select_candidates(
    table: LoadedTable,
    tenant: TenantEntry,
    model: str,
    fleet: FleetState | FleetView,
    client_location: Point | None,
    *,
    limit: int | None = None,
    rng: random.Random | None = None,
    also: Collection[str] = (),
) -> list[Candidate]:
    """Usable replicas for this tenant and model, unordered; typed errors when none.

    `fleet`: the router's view of it (a bare FleetState: no breaker, RTTs by distance). With
    `limit`, at most that many (the module doc: nearest tiers, then a sample drawn with
    `rng`), plus those of the nodes `also` names that are usable (a stored response's, a
    prefix holder).
    """
    serving = _serving_model(table, tenant, model)
    picker = _Picker(fleet, client_location)
    tiers = _tiers(table, tenant, table.ready_by_model_region.get(serving, {}), picker.rtt_of)
    total = sum(len(nodes) for tier in tiers for _region, nodes in tier)
    if limit is None or total <= limit:
        for tier in tiers:
            for region, nodes in tier:
                picker.offer_all(region, nodes)
    else:
        _pick_bounded(picker, tiers, limit, rng or _RNG)
    if also:
        picker.offer_named(table, tenant, serving, also)
    if not picker.out:
        back_in_s = picker.back_in_s
        retry_after_s = 1 if math.isinf(back_in_s) else min(_MAX_RETRY_AFTER_S, math.ceil(back_in_s))
        raise exhausted_error(tenant, model, retry_after_s)
    return picker.out


def named_candidates(
    table: LoadedTable,
    tenant: TenantEntry,
    model: str,
    fleet: FleetState | FleetView,
    client_location: Point | None,
    node_ids: Collection[str],
) -> list[Candidate]:
    """The usable ones of `node_ids` (select_candidates' checks, no bound, no error): a
    replica named by what it holds (a prompt's prefix) that a bounded set left out."""
    try:
        serving = _serving_model(table, tenant, model)
    except ModelNotFound:
        return []
    picker = _Picker(fleet, client_location)
    picker.offer_named(table, tenant, serving, node_ids)
    return picker.out


def _serving_model(table: LoadedTable, tenant: TenantEntry, model: str) -> str:
    """The model name the table's nodes list for `model` (a LoRA adapter runs on its base's)."""
    if not tenant.may_use(model):
        raise ModelNotFound(model)
    if model in table.nodes_by_model:
        return model
    base, _adapter = split_adapter(model)
    if base != model and base in table.nodes_by_model:
        # A LoRA adapter (`base:adapter`, as nodes name them) runs on its base model's nodes.
        return base
    raise ModelNotFound(model)


# A tier: regions equally far from the client (all of them for an unknown client), with
# their READY nodes of the model.
_Tier = list[tuple[RegionInfo, tuple[RoutingNode, ...]]]


def _tiers(
    table: LoadedTable,
    tenant: TenantEntry,
    by_region: Mapping[str, tuple[RoutingNode, ...]],
    rtt_of: Callable[[RegionInfo], float],
) -> list[_Tier]:
    """The tenant's regions of the model, nearest tier first: O(regions), no node touched."""
    admitted: list[tuple[float, str, RegionInfo]] = []
    for name in by_region:
        region = table.regions.get(name)
        # A node in a region the table does not describe has no known zone: never use it.
        if region is not None and tenant_may_use(tenant, region):
            admitted.append((rtt_of(region), name, region))
    admitted.sort(key=lambda a: (a[0], a[1]))
    tiers: list[_Tier] = []
    last: float | None = None
    for rtt_ms, name, region in admitted:
        if rtt_ms != last:
            tiers.append([])
            last = rtt_ms
        tiers[-1].append((region, by_region[name]))
    return tiers


class _Picker:
    """Builds the candidates: the usability checks on one node, and what an ejection says."""

    __slots__ = ("_allows", "_client", "_fleet", "_rtt", "_rtts", "back_in_s", "out")

    def __init__(self, fleet: FleetState | FleetView, client: Point | None) -> None:
        view = fleet if isinstance(fleet, FleetView) else FleetView(fleet)
        self._fleet = view.fleet
        self._allows = view.allows
        self._rtt = view.rtt
        self._client = client
        self._rtts: dict[str, float] = {}
        self.out: list[Candidate] = []
        # How soon an ejected replica the tenant could use is tried again (the 503's Retry-After).
        self.back_in_s = math.inf

    def rtt_of(self, region: RegionInfo) -> float:
        rtt_ms = self._rtts.get(region.name)
        if rtt_ms is None:
            rtt_ms = self._rtts[region.name] = self._rtt(self._client, region)
        return rtt_ms

    def offer(self, node: RoutingNode, region: RegionInfo) -> bool:
        """Add `node` (READY, in a region the tenant may use) unless ejected or refused."""
        node_id = node.node_id
        if self._fleet.is_ejected(node_id):
            self.back_in_s = min(self.back_in_s, self._fleet.ejected_for_s(node_id))
            return False
        if self._allows is not None and not self._allows(node_id):
            return False
        self.out.append(Candidate(node=node, region=region, rtt_ms=self.rtt_of(region),
                                  in_flight=self._fleet.in_flight(node_id)))
        return True

    def offer_all(self, region: RegionInfo, nodes: Sequence[RoutingNode]) -> None:
        for node in nodes:
            self.offer(node, region)

    def offer_named(self, table: LoadedTable, tenant: TenantEntry, model: str, node_ids: Collection[str]) -> None:
        """Add the usable ones of `node_ids` not in yet: the same checks as every other node."""
        have = {c.node.node_id for c in self.out}
        for node_id in node_ids:
            node = table.nodes_by_id.get(node_id)
            if node is None or node_id in have or model not in node.models or node.status != NodeStatus.READY:
                continue
            region = table.regions.get(node.region)
            if region is not None and tenant_may_use(tenant, region) and self.offer(node, region):
                have.add(node_id)


def _pick_bounded(picker: _Picker, tiers: list[_Tier], limit: int, rng: random.Random) -> None:
    """At most `limit` candidates: whole tiers nearest first while they fit in the near share,
    a random draw from the tier that does not, then a uniform draw from everything left."""
    near = limit - max(1, limit // _SAMPLE_SHARE)
    rest: _Tier = []
    overflow = 0  # nodes of the tier that did not fit, first in `rest`
    for i, tier in enumerate(tiers):
        size = sum(len(nodes) for _region, nodes in tier)
        if not rest and len(picker.out) + size <= near:
            for region, nodes in tier:
                picker.offer_all(region, nodes)
            continue
        if not rest:
            overflow = size
        rest.extend(tier)
        if i + 1 < len(tiers):
            rest.extend(g for t in tiers[i + 1:] for g in t)
        break
    if not rest:
        return
    draw = _Draw(rest, rng)
    # The overflowing tier is as near as the client gets beyond the whole tiers: its share first.
    while len(picker.out) < near and draw.taken < overflow:
        picker.offer(*draw.next(overflow))
    while len(picker.out) < limit and draw.taken < draw.size:
        picker.offer(*draw.next(draw.size))


class _Draw:
    """Nodes of some regions in random order without replacement, lazily: a Fisher-Yates
    shuffle that only records the positions it swapped, so each draw costs O(log regions)
    whatever the number of nodes. `next(bound)` draws among the first `bound` positions not
    drawn yet: the nearest tier first, then all that is left, uniformly."""

    def __init__(self, groups: _Tier, rng: random.Random) -> None:
        self._groups = groups
        self._starts: list[int] = []
        size = 0
        for _region, nodes in groups:
            self._starts.append(size)
            size += len(nodes)
        self.size = size
        self.taken = 0
        self._rng = rng
        self._moved: dict[int, int] = {}

    def next(self, bound: int) -> tuple[RoutingNode, RegionInfo]:
        j = self.taken
        k = self._rng.randrange(j, bound)
        moved = self._moved
        drawn = moved.get(k, k)
        moved[k] = moved.get(j, j)
        self.taken = j + 1
        g = bisect.bisect_right(self._starts, drawn) - 1
        region, nodes = self._groups[g]
        return nodes[drawn - self._starts[g]], region


def exhausted_error(tenant: TenantEntry, model: str, retry_after_s: int = 1) -> NoReplicaInZone | NoHealthyReplica:
    """The 503 to answer when no replica the tenant may use can serve `model`."""
    if not residency.is_bound(tenant.zone):
        return NoHealthyReplica(model, retry_after_s)
    return NoReplicaInZone(model, tenant.zone, retry_after_s)


def models_for(table: LoadedTable, tenant: TenantEntry) -> list[str]:
    """Models the tenant may use that some ready node in its zone serves."""
    admitted: dict[str, bool] = {}  # region -> the tenant may be served there

    def may_serve(name: str) -> bool:
        if name not in admitted:
            region = table.regions.get(name)
            admitted[name] = region is not None and tenant_may_use(tenant, region)
        return admitted[name]

    return sorted(
        model for model, regions in table.ready_by_model_region.items()
        if tenant.may_use(model) and any(may_serve(r) for r in regions)
    )


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
