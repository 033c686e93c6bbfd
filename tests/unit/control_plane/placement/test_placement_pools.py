"""Placement of prefill/decode disaggregated deployments: both pools in every region used."""

from __future__ import annotations

from collections import defaultdict

import pytest
from placement_world import SHAPES

from control_plane.placement import Assignment, Deployment, Problem, solve
from control_plane.placement.check import violations
from control_plane.placement.pools import PoolPlan, split_pools
from meridian.contracts import RegionInfo
from providers.offerings import Offering


def _eu(disaggregated: bool, **kw: object) -> Deployment:
    return Deployment(name="d", shapes=SHAPES, zone="eu", demand_tokens_per_s={"aws:eu-central-1": 400.0},
                      rtt_objective_ms=30.0, disaggregated=disaggregated, **kw)  # type: ignore[arg-type]


def _instances(plan: tuple[Assignment, ...]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for a in plan:
        out[a.region] += a.instances
    return dict(out)


def test_every_region_of_a_disaggregated_deployment_holds_a_prefill_and_a_decode_node(
    regions: dict[str, RegionInfo], offerings: list[Offering]
) -> None:
    colocated = solve(Problem([_eu(False)], offerings, regions))
    assert set(_instances(colocated.assignments).values()) == {1}
    problem = Problem([_eu(True)], offerings, regions)
    result = solve(problem)
    assert result.feasible and violations(problem, list(result.assignments)) == []
    used = _instances(result.assignments)
    assert len(used) >= 2 and min(used.values()) >= 2
    # Residency first: the EU deployment's pools are all in the EU.
    assert all("eu" in regions[r].zones for r in used)

    split = split_pools(PoolPlan({"L4-24GB": 0.5, "H100-80GB-SXM": 0.5}), result.assignments)
    roles: dict[str, set[str]] = defaultdict(set)
    for a in split:
        roles[a.region].add(a.role)
    assert all(r == {"prefill", "decode"} for r in roles.values())
    assert _instances(tuple(split)) == used  # nothing gained or lost in the split


def test_a_region_that_cannot_host_both_pools_is_not_used(
    regions: dict[str, RegionInfo], offerings: list[Offering]
) -> None:
    # gcp:europe-west4 (the cheapest) has room for one L4 instance only.
    capacity = {("gcp:europe-west4", "L4-24GB"): 1, ("gcp:europe-west4", "H100-80GB-SXM"): 0}
    one = {"min_regions": 1, "min_providers": 1}
    colocated = solve(Problem([_eu(False, **one)], offerings, regions, capacity=capacity))
    assert _instances(colocated.assignments) == {"gcp:europe-west4": 1}
    problem = Problem([_eu(True, **one)], offerings, regions, capacity=capacity)
    result = solve(problem)
    assert result.feasible and violations(problem, list(result.assignments)) == []
    assert "gcp:europe-west4" not in _instances(result.assignments)
    assert min(_instances(result.assignments).values()) >= 2


def test_a_lone_instance_of_a_disaggregated_deployment_is_a_violation(
    regions: dict[str, RegionInfo], offerings: list[Offering]
) -> None:
    d = _eu(True, min_regions=1, min_providers=1)
    lone = [Assignment("d", "gcp:europe-west4", "gcp-l4-1", "L4-24GB", 1, 1, cost_per_hour=0.9)]
    assert any(v.startswith("pools:") for v in violations(Problem([d], offerings, regions), lone))
    with pytest.raises(ValueError, match="needs 2"):
        split_pools(PoolPlan({"L4-24GB": 1.0}), lone)


def _row(region: str, instances: int, instance_type: str = "gcp-l4-1") -> Assignment:
    return Assignment("d", region, instance_type, "L4-24GB", instances, instances, cost_per_hour=1.0 * instances)


def _pools(split: list[Assignment]) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for a in split:
        out[a.region][0 if a.role == "prefill" else 1] += a.instances
    return {r: (p, d) for r, (p, d) in out.items()}


def test_regions_split_by_the_ratio_or_the_declared_pools() -> None:
    rows = [_row("gcp:europe-west4", 6), _row("aws:eu-central-1", 3, "aws-l4-1"), _row("aws:eu-central-1", 1),
            _row("gcp:europe-west1", 2)]
    plan = PoolPlan({"L4-24GB": 0.5}, pools={"gcp:europe-west1": (1, 1)})
    split = split_pools(plan, rows)
    # 1 prefill per 2 decode; each pool one node at least; declared pools where named.
    assert _pools(split) == {"gcp:europe-west4": (2, 4), "aws:eu-central-1": (1, 3), "gcp:europe-west1": (1, 1)}
    # A row split between the roles keeps its cost and replicas in proportion.
    assert sum(a.cost_per_hour for a in split) == pytest.approx(sum(a.cost_per_hour for a in rows))
    assert all(a.replicas == a.instances for a in split)
    # A prompt-heavy ratio still leaves a decode node.
    assert _pools(split_pools(PoolPlan({"L4-24GB": 20.0}), [_row("gcp:europe-west4", 3)])) == {
        "gcp:europe-west4": (2, 1)}
