"""Prefill and decode pools of a disaggregated deployment's placement.

The solver places a disaggregated deployment like any other, with two differences: each
replica counts for the decode share of its throughput (1 / (1 + prefill per decode), as only
decode replicas generate), and every region it uses holds at least two instances, since a
node has one role and a region runs both pools or none (KV moves only inside a region, so
never outside its zone). `split_pools` then gives each of a region's instances its role:
the explicit pool sizes of that region where the deployment names them, else its
prefill:decode ratio, each pool at least one instance. Roles are per instance (node), so a
plan row (an Assignment) is split into a prefill row and a decode row.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from control_plane.placement.problem import Assignment
from meridian.contracts import NodeRole

# A disaggregated region holds a prefill and a decode node at least.
MIN_INSTANCES_PER_REGION = 2


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """How one disaggregated deployment splits a region: prefill replicas per decode replica on
    each SKU, and explicit (prefill, decode) replica counts per region."""

    prefill_per_decode: Mapping[str, float]
    pools: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def decode_share(self, sku: str) -> float:
        """The share of a region's replicas that decode (and so serve generated tokens)."""
        return 1.0 / (1.0 + self.prefill_per_decode.get(sku, 1.0))


def _prefill_instances(total: int, prefill_share: float) -> int:
    return min(total - 1, max(1, round(total * prefill_share)))


def split_pools(plan: PoolPlan, assignments: Sequence[Assignment]) -> list[Assignment]:
    """The deployment's assignments with a role each, prefill rows first in each region."""
    by_region: dict[str, list[Assignment]] = defaultdict(list)
    for a in assignments:
        by_region[a.region].append(a)
    out: list[Assignment] = []
    for region in sorted(by_region):
        rows = sorted(by_region[region], key=lambda a: (a.instance_type, a.spot))
        total = sum(a.instances for a in rows)
        if total < MIN_INSTANCES_PER_REGION:
            raise ValueError(f"{rows[0].deployment} has {total} instance in {region}; a disaggregated region "
                             f"needs {MIN_INSTANCES_PER_REGION}")
        explicit = plan.pools.get(region)
        if explicit is not None:
            share = explicit[0] / (explicit[0] + explicit[1])
        else:
            ratio = plan.prefill_per_decode.get(rows[0].sku, 1.0)
            share = ratio / (1.0 + ratio)
        out.extend(_split_region(rows, _prefill_instances(total, share)))
    return out


def _split_region(rows: Sequence[Assignment], prefill: int) -> list[Assignment]:
    """Take `prefill` instances from the region's rows in order for the prefill pool."""
    out: list[Assignment] = []
    for a in rows:
        take = min(prefill, a.instances)
        prefill -= take
        for role, n in ((NodeRole.PREFILL, take), (NodeRole.DECODE, a.instances - take)):
            if n:
                out.append(replace(a, instances=n, replicas=a.replicas * n // a.instances,
                                   cost_per_hour=a.cost_per_hour * n / a.instances, role=role.value))
    return out
