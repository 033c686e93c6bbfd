"""Which candidates prefill and which decode (pure).

The routing policy has ordered every candidate (nearest region first, then affinity and
load). Disaggregation splits that order by role:

- Decode-capable candidates (role `decode` or co-located `both`) keep the policy's order of
  regions, and within a region decode workers go by load and KV headroom: a decode worker's
  prefix cache matters little (the prompt's KV arrives from the prefill worker) and its KV
  usage is what it runs out of.
- Prefill workers are grouped by region, ordered by prefix affinity (a prefill worker that
  holds the prompt's prefix computes less), then by load.
- A decode worker is served disaggregated only when its region has a prefill worker with
  the same KV connector; otherwise it prefills itself (co-located fallback).
- With no decode-capable candidate at all, the prefill workers serve co-located: a pool
  being empty costs latency, never the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meridian.contracts import KVConnector, NodeRole

from ...selection.candidates import Candidate

# How much a decode worker's KV usage (0..1) weighs against one pending request.
KV_USAGE_WEIGHT = 4.0


@dataclass(frozen=True, slots=True)
class PDPlan:
    """The order decode attempts go in, and each region's prefill pool by connector."""

    decode: list[Candidate]
    prefill: dict[tuple[str, KVConnector], list[Candidate]] = field(default_factory=dict)

    def prefill_pool(self, candidate: Candidate) -> list[Candidate]:
        """The prefill workers that may hand `candidate` its KV (empty: it prefills itself)."""
        transfer = candidate.node.kv_transfer
        if candidate.node.role is not NodeRole.DECODE or transfer is None:
            return []
        return self.prefill.get((candidate.region.name, transfer.connector), [])

    @property
    def disaggregated(self) -> bool:
        return any(self.prefill_pool(c) for c in self.decode)


def _decode_cost(candidate: Candidate) -> float:
    return candidate.pending + KV_USAGE_WEIGHT * candidate.kv_usage


def _prefill_key(candidate: Candidate) -> tuple[float, float, int]:
    return (-candidate.prefix_hit, candidate.queue_ms, candidate.pending)


def plan(ordered: Sequence[Candidate]) -> PDPlan:
    """Split the policy's order into decode attempts and prefill pools (see the module doc)."""
    prefill: dict[tuple[str, KVConnector], list[Candidate]] = {}
    decoders: list[Candidate] = []
    for c in ordered:
        if c.node.role is NodeRole.PREFILL and c.node.kv_transfer is not None:
            prefill.setdefault((c.region.name, c.node.kv_transfer.connector), []).append(c)
        else:
            decoders.append(c)
    if not prefill:
        return PDPlan(list(ordered))
    if not decoders:  # the decode pool is empty: prefill workers serve the whole request
        return PDPlan(list(ordered))
    for pool in prefill.values():
        pool.sort(key=_prefill_key)
    return PDPlan(_by_region_then_cost(decoders), prefill)


def _by_region_then_cost(candidates: list[Candidate]) -> list[Candidate]:
    """The policy's order of regions; inside each region, decode workers by load and KV
    headroom (co-located ones keep the policy's place after them)."""
    rank: dict[str, int] = {}
    for c in candidates:
        rank.setdefault(c.region.name, len(rank))
    index = {id(c): i for i, c in enumerate(candidates)}

    def key(c: Candidate) -> tuple[int, int, float, int]:
        decode = c.node.role is NodeRole.DECODE
        return (rank[c.region.name], 0 if decode else 1, _decode_cost(c) if decode else 0.0, index[id(c)])

    return sorted(candidates, key=key)
