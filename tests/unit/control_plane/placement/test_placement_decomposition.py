"""The fleet-sized solve path: independent groups, block models retargeted, threads, the proven bound."""

from __future__ import annotations

import random
from dataclasses import replace

from placement_world import SHAPES

from control_plane.placement import Deployment, Problem, SolveOptions, solve
from control_plane.placement.candidates import build_candidates
from control_plane.placement.check import violations
from control_plane.placement.model import CurrentPlan, PlacementModel
from control_plane.placement.solver import coupled_groups
from meridian.contracts import RegionInfo
from providers.offerings import Offering

EXACT = SolveOptions(mip_rel_gap=0.0)
ZONES = {"us": ["aws:us-east-1", "aws:us-east-2", "gcp:us-east4", "aws:us-west-2", "gcp:us-west1"],
         "eu": ["aws:eu-central-1", "gcp:europe-west4", "gcp:europe-west1", "onprem:fra-dc1"]}
# Scarce H100s in both zones: within a zone the deployments compete for them.
QUOTAS = {("onprem:fra-dc1", "H100-80GB-SXM"): 8, ("gcp:europe-west4", "H100-80GB-SXM"): 8,
          ("gcp:us-east4", "H100-80GB-SXM"): 8, ("aws:us-east-1", "H100-80GB-SXM"): 8}


def _zoned(seed: int, n: int) -> list[Deployment]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        zone = ("us", "eu")[i % 2]
        clients = rng.sample(ZONES[zone], k=rng.randint(1, 2))
        out.append(Deployment(f"d{i}", SHAPES, zone=zone,
                              demand_tokens_per_s={c: float(rng.randint(2000, 9000)) for c in clients},
                              rtt_objective_ms=80.0, spot_allowed=rng.random() < 0.3))
    return out


def _options(problem: Problem) -> list[int]:
    cands, errors = build_candidates(problem)
    assert not errors
    return [sum(len(cands[i].options) for i in g) for g in coupled_groups(problem, cands)]


def test_zones_that_share_no_quota_are_independent_groups_solved_exactly(
        regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    problem = Problem(_zoned(seed=4, n=8), offerings, regions, capacity=QUOTAS)
    sizes = _options(problem)
    assert len(sizes) == 2  # the us deployments and the eu ones
    whole = solve(problem, EXACT)
    # Each group fits the joint limit, the whole does not: the groups are solved apart, each exactly.
    apart = solve(problem, replace(EXACT, joint_max_options=max(sizes)))
    assert whole.status == apart.status == "optimal"
    assert apart.notes[0].startswith("2 independent groups")
    assert abs(apart.objective - whole.objective) <= 1e-6 * whole.objective
    assert abs(apart.lower_bound - whole.lower_bound) <= 1e-6 * whole.objective
    assert violations(problem, list(apart.assignments)) == []


def test_a_quota_joins_groups_only_when_it_can_bind(regions: dict[str, RegionInfo],
                                                    offerings: list[Offering]) -> None:
    eu = Deployment("eu", SHAPES, zone="eu", demand_tokens_per_s={"aws:eu-central-1": 5000.0})
    anywhere = Deployment("g", SHAPES, zone="global", demand_tokens_per_s={"aws:eu-central-1": 5000.0})
    us = Deployment("us", SHAPES, zone="us", demand_tokens_per_s={"aws:us-east-1": 5000.0})
    problem = Problem([eu, anywhere, us], offerings, regions, capacity={("onprem:fra-dc1", "H100-80GB-SXM"): 8})
    cands, _ = build_candidates(problem)
    assert coupled_groups(problem, cands) == [[0, 1], [2]]
    # A quota larger than all that could ever use it couples nobody.
    roomy = replace(problem, capacity={("onprem:fra-dc1", "H100-80GB-SXM"): 10_000})
    assert coupled_groups(roomy, cands) == [[0], [1], [2]]


def test_decomposition_on_threads_finds_the_same_plan_as_one_at_a_time(regions: dict[str, RegionInfo],
                                                                      offerings: list[Offering]) -> None:
    problem = Problem(_zoned(seed=9, n=10), offerings, regions, capacity=QUOTAS)
    one = solve(problem, SolveOptions(joint_max_options=0, threads=1, time_limit_s=60))
    two = solve(problem, SolveOptions(joint_max_options=0, threads=2, time_limit_s=60))
    assert one.feasible and two.feasible
    assert sorted(a.key + (a.instances,) for a in one.assignments) == sorted(a.key + (a.instances,)
                                                                                for a in two.assignments)
    assert violations(problem, list(two.assignments)) == []
    # The bound is proven, below the plan, and the gap is measured against it.
    assert two.lower_bound <= two.objective
    assert abs(two.mip_gap - (two.objective - two.lower_bound) / two.objective) <= 1e-9


def test_a_retargeted_block_model_is_the_model_built_for_its_quotas(regions: dict[str, RegionInfo],
                                                                    offerings: list[Offering]) -> None:
    problem = Problem(_zoned(seed=2, n=2), offerings, regions, capacity=QUOTAS)
    cands, _ = build_candidates(problem)
    current = CurrentPlan.of(problem)
    left = {k: q // 2 for k, q in QUOTAS.items()}
    prices = {("onprem:fra-dc1", "H100-80GB-SXM"): 0.75, ("gcp:us-east4", "H100-80GB-SXM"): 1.5}
    for cand in cands:
        reused = PlacementModel(problem, current, [cand], QUOTAS)
        reused.retarget(left, prices)
        fresh = PlacementModel(problem, current, [cand], left, key_price=prices)
        assert reused.milp.cost == fresh.milp.cost
        assert reused.milp.col_upper == fresh.milp.col_upper
        assert reused.milp.row_upper == fresh.milp.row_upper
