"""Routing policies: the order in which a request tries the replicas selection allowed.

A policy sees only candidates that residency, health and circuit breakers already let
through (geo_router.selection.candidates), each annotated with what the router knows of it: RTT,
load, how much of the prompt's KV prefix it holds and whether it has the LoRA adapter
(geo_router.selection.affinity). Policies are chosen by name (`RouterSettings.routing_policy`)
from a small registry (`POLICIES`, a meridian.registry.Registry), as vLLM production-stack's
router does.

`affinity` (the default) orders regions by RTT, spilling past a region whose queueing
time would break the latency objective, then scores each region's replicas on KV-prefix
overlap, LoRA residency and load, with an imbalance gate that falls back to least-load
so that affinity never piles requests onto one hot replica. `nearest`, `least-load` and
`round-robin` are the simple baselines the benchmarks compare against.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from meridian.registry import Registry
from meridian.settings.router import RouterSettings

from .candidates import Candidate, LoraState, RoutingContext

# Prefix shares closer than this (one block in twenty) count as the same.
_SAME_PREFIX = 0.05
# What a replica's LoRA state is worth to a request for an adapter (0..1).
_LORA_VALUE = {
    LoraState.LOADED: 1.0,
    LoraState.FREE_SLOT: 0.5,
    LoraState.NONE: 0.0,
    LoraState.NOT_REQUESTED: 0.0,
}


class RoutingPolicy(Protocol):
    """Orders candidates, best first. Must not add any: residency was already applied."""

    name: str

    def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]: ...


class _Rotation:
    """Breaks ties between equally good replicas in turn, so idle replicas share the work.

    Each call of `next_turn` gives one request's turn; every region's replicas are rotated
    by it, so each region's replicas take turns whatever the other regions hold.
    """

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next_turn(self) -> int:
        return next(self._counter)

    @staticmethod
    def rotated(candidates: Sequence[Candidate], turn: int) -> list[Candidate]:
        ordered = sorted(candidates, key=lambda c: c.node.node_id)
        if len(ordered) < 2:
            return ordered
        k = turn % len(ordered)
        return ordered[k:] + ordered[:k]

    def rotated_by_region(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        turn = self.next_turn()
        out: list[Candidate] = []
        for group in _by_region(candidates).values():
            out.extend(self.rotated(group, turn))
        return out


def _by_region(candidates: Sequence[Candidate]) -> dict[str, list[Candidate]]:
    groups: dict[str, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.region.name, []).append(c)
    return groups


class NearestPolicy:
    """Nearest region first; within a region the least busy node (at this router), then id."""

    name = "nearest"

    def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.rtt_ms, c.in_flight, c.node.node_id))


class LeastLoadPolicy:
    """Nearest region first; within it the replica with the fewest pending requests."""

    name = "least-load"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]:
        # A stable sort of a rotated list: equal loads take turns.
        return sorted(
            self._rotation.rotated_by_region(candidates), key=lambda c: (c.rtt_ms, c.pending, c.kv_usage)
        )


class RoundRobinPolicy:
    """Nearest region first; within it replicas in turn, whatever they hold or carry."""

    name = "round-robin"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]:
        return sorted(self._rotation.rotated_by_region(candidates), key=lambda c: c.rtt_ms)


@dataclass(frozen=True, slots=True)
class AffinityWeights:
    """How much each signal counts in a replica's score (see AffinityPolicy)."""

    prefix: float = 1.0
    lora: float = 0.5
    load: float = 0.5
    kv_usage: float = 0.2
    balance: float = 0.5


class AffinityPolicy:
    """KV-prefix and LoRA affinity within the nearest region that meets the latency objective.

    Score of a replica = prefix·(share of the prompt's blocks it holds) + lora·(1 loaded,
    ½ free adapter slot, 0 neither) − load·(pending / max(most pending in the region,
    load_scale)) − kv_usage·(KV cache usage) − balance·(excess of its share of the requests
    this router sent lately over the region's mean: (recent+1)/(mean+1) − 1, at least 0).
    `load_scale` keeps one request more or less from outweighing a whole cached prompt on
    lightly loaded replicas; the balance term spreads new conversations while a long cached
    conversation still outweighs a modest excess. When no replica holds more of the prompt
    or is readier for its adapter than another, scoring has nothing to trade against load:
    the region is ordered least-load, then by the recent-share excess and KV usage (as
    SGLang's cache-aware router falls back to the shortest queue). The imbalance gate: when
    the best-scoring replica has more than `imbalance_abs` pending requests beyond the least
    loaded one and more than `imbalance_ratio` times its load, the region is ordered
    least-load first instead.
    """

    name = "affinity"

    def __init__(
        self,
        weights: AffinityWeights = AffinityWeights(),
        *,
        latency_objective_ms: float = 1000.0,
        imbalance_abs: int = 4,
        imbalance_ratio: float = 1.5,
        load_scale: int = 2,
    ) -> None:
        self.weights = weights
        self.latency_objective_ms = latency_objective_ms
        self.imbalance_abs = imbalance_abs
        self.imbalance_ratio = imbalance_ratio
        self.load_scale = max(1, load_scale)
        self._rotation = _Rotation()
        # How often the gate overrode affinity (exported as a metric by the app).
        self.imbalance_fallbacks = 0

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> AffinityPolicy:
        return cls(
            AffinityWeights(
                prefix=settings.affinity_prefix_weight,
                lora=settings.affinity_lora_weight,
                load=settings.affinity_load_weight,
                kv_usage=settings.affinity_kv_usage_weight,
                balance=settings.affinity_balance_weight,
            ),
            latency_objective_ms=settings.latency_objective_ms,
            imbalance_abs=settings.imbalance_abs_threshold,
            imbalance_ratio=settings.imbalance_ratio,
            load_scale=settings.affinity_load_scale,
        )

    def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]:
        groups = _by_region(candidates)
        turn = self._rotation.next_turn()
        out: list[Candidate] = []
        for region in self.region_order(groups):
            out.extend(self._order_region(groups[region], turn))
        return out

    def region_order(self, groups: dict[str, list[Candidate]]) -> list[str]:
        """Regions by RTT; one whose RTT plus queueing breaks the objective spills behind those that meet it."""

        def rtt(region: str) -> float:
            return groups[region][0].rtt_ms

        def cost(region: str) -> float:
            return rtt(region) + min(c.queue_ms for c in groups[region])

        by_rtt = sorted(groups, key=lambda r: (rtt(r), r))
        meets = [r for r in by_rtt if cost(r) <= self.latency_objective_ms]
        rest = sorted((r for r in by_rtt if r not in meets), key=lambda r: (cost(r), r))
        return meets + rest

    def score(self, c: Candidate, most_pending: int, mean_recent: float) -> float:
        w = self.weights
        excess = self._excess(c, mean_recent)
        return (
            w.prefix * c.prefix_hit
            + w.lora * _LORA_VALUE[c.lora]
            - w.load * c.pending / max(most_pending, self.load_scale)
            - w.kv_usage * c.kv_usage
            - w.balance * excess
        )

    def _order_region(self, cands: list[Candidate], turn: int) -> list[Candidate]:
        if len(cands) < 2:
            return cands
        most = max(c.pending for c in cands)
        least = min(c.pending for c in cands)
        mean_recent = sum(c.recent for c in cands) / len(cands)
        rotated = self._rotation.rotated(cands, turn)
        if not _affinity_differs(cands):
            # Nothing cached or loaded sets a replica apart (a new conversation whose system
            # prompt every replica holds, a prompt nobody has seen): least-load, then the
            # replica that took fewest of the recent requests, so new conversations spread.
            return sorted(rotated, key=lambda c: (c.pending, self._excess(c, mean_recent), c.kv_usage))
        scores = {c.node.node_id: self.score(c, most, mean_recent) for c in cands}
        ranked = sorted(rotated, key=lambda c: (-scores[c.node.node_id], c.pending))
        best = ranked[0]
        if best.pending - least > self.imbalance_abs and best.pending > self.imbalance_ratio * max(least, 1):
            self.imbalance_fallbacks += 1
            ranked = sorted(rotated, key=lambda c: (c.pending, -scores[c.node.node_id]))
        return ranked

    @staticmethod
    def _excess(c: Candidate, mean_recent: float) -> float:
        """How far above its fair share of recent requests the replica is (0 at or below it)."""
        return max(0.0, (c.recent + 1.0) / (mean_recent + 1.0) - 1.0)


def _affinity_differs(cands: Sequence[Candidate]) -> bool:
    """Whether some replica holds more of the prompt, or is readier for its adapter, than another."""
    hits = [c.prefix_hit for c in cands]
    return max(hits) - min(hits) > _SAME_PREFIX or len({c.lora for c in cands}) > 1


PolicyFactory = Callable[[RouterSettings], RoutingPolicy]

# The policies by name; an unknown name is meridian.registry's UnknownName.
POLICIES: Registry[PolicyFactory] = Registry("routing policy")
POLICIES.register("nearest", lambda _settings: NearestPolicy())
POLICIES.register("least-load", lambda _settings: LeastLoadPolicy())
POLICIES.register("round-robin", lambda _settings: RoundRobinPolicy())
POLICIES.register("affinity", AffinityPolicy.from_settings)


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy available to `RouterSettings.routing_policy` under `name`."""
    POLICIES.register(name, factory)


def policy_names() -> list[str]:
    return POLICIES.names()


def create_policy(name: str, settings: RouterSettings) -> RoutingPolicy:
    """Build the policy registered under `name` (UnknownName when there is none)."""
    return POLICIES.get(name)(settings)
