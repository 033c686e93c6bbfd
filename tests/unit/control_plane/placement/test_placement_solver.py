"""The placement solver on a small fixed world (see conftest): each rule, the explanations, churn, diff."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from placement_world import SHAPES

from control_plane.placement import (
    Assignment,
    Deployment,
    Problem,
    SolveOptions,
    diff,
    fit_model,
    shapes_from_fit,
    solve,
)
from control_plane.placement.check import violations
from control_plane.placement.models import LLAMA_3_8B, LLAMA_3_70B
from meridian.contracts import RegionInfo
from providers.offerings import Offering

EXACT = SolveOptions(mip_rel_gap=0.0)


def dep(name: str, zone: str, demand: dict[str, float], **kw: object) -> Deployment:
    return Deployment(name=name, shapes=SHAPES, zone=zone, demand_tokens_per_s=demand, **kw)  # type: ignore[arg-type]


def solved(problem: Problem, options: SolveOptions = EXACT) -> list[Assignment]:
    result = solve(problem, options)
    assert result.feasible, result.explanation
    assert violations(problem, list(result.assignments)) == []
    return list(result.assignments)


def test_zoned_deployment_stays_in_zone_and_within_rtt(regions: dict[str, RegionInfo],
                                                       offerings: list[Offering]) -> None:
    eu = dep("eu-chat", "eu", {"aws:eu-central-1": 3000.0}, rtt_objective_ms=30.0)
    us = dep("us-chat", "global", {"aws:us-east-1": 1200.0}, rtt_objective_ms=30.0)
    plan = solved(Problem([eu, us], offerings, regions))
    eu_regions = {a.region for a in plan if a.deployment == "eu-chat"}
    assert eu_regions <= {"aws:eu-central-1", "gcp:europe-west4", "gcp:europe-west1", "onprem:fra-dc1"}
    # A global deployment may go anywhere, but only regions within 30 ms of us-east-1 serve it.
    assert {a.region for a in plan if a.deployment == "us-chat"} == {"aws:us-east-1", "gcp:us-east4"}


def test_spread_two_regions_two_providers(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    plan = solved(Problem([dep("d", "us", {"aws:us-east-1": 400.0}, rtt_objective_ms=30.0)], offerings, regions))
    assert {a.region for a in plan} == {"aws:us-east-1", "gcp:us-east4"}
    # One region is enough when spread asks for one (providers default to what exists: one).
    single = dep("d", "us", {"aws:us-east-1": 400.0}, rtt_objective_ms=30.0, min_regions=1, min_providers=1)
    plan = solved(Problem([single], offerings, regions))
    assert len({a.region for a in plan}) == 1 and plan[0].region == "gcp:us-east4"  # the cheaper L4


def test_infeasible_zone_far_from_client(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    d = dep("tokyo-only", "apac", {"aws:us-east-1": 100.0}, rtt_objective_ms=30.0)
    result = solve(Problem([d], offerings, regions))
    assert result.status == "infeasible"
    assert any("deployment tokyo-only: no region of zone 'apac'" in line and "within 30 ms" in line
               for line in result.explanation)


def test_infeasible_spread_names_the_zone_and_its_regions(regions: dict[str, RegionInfo],
                                                          offerings: list[Offering]) -> None:
    d = dep("x", "apac", {"aws:ap-northeast-1": 100.0})
    result = solve(Problem([d], offerings, regions))
    assert result.status == "infeasible"
    assert result.explanation == (
        "deployment x: zone 'apac' has only 1 region [aws:ap-northeast-1] offering the allowed SKUs"
        " [H100-80GB-SXM, L4-24GB] within 50 ms of its client regions, spread requires 2",
    )
    # Providers: the us zone has two, an explicit 3 cannot be met; the default (2) can.
    d3 = dep("y", "us", {"aws:us-east-1": 100.0}, rtt_objective_ms=80.0, min_providers=3)
    result = solve(Problem([d3], offerings, regions))
    assert result.status == "infeasible"
    assert "span only the providers [aws, gcp], spread requires 3" in result.explanation[0]


def test_infeasible_when_no_allowed_sku_fits(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    d = dep("z", "eu", {"aws:eu-central-1": 100.0}, allowed_skus=frozenset({"T4-16GB"}))
    result = solve(Problem([d], offerings, regions))
    assert result.explanation == ("deployment z: the model fits none of the allowed SKUs [T4-16GB]"
                                  " (it fits [H100-80GB-SXM, L4-24GB])",)


def test_capacity_quota_is_respected(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    # On-prem H100 is cheapest per token; its quota (one 8-GPU host) caps how much goes there.
    d = dep("big", "eu", {"aws:eu-central-1": 40000.0}, rtt_objective_ms=30.0)
    problem = Problem([d], offerings, regions, capacity={("onprem:fra-dc1", "H100-80GB-SXM"): 8})
    plan = solved(problem)
    onprem = [a for a in plan if a.region == "onprem:fra-dc1"]
    assert sum(a.instances for a in onprem) == 1
    unlimited = solved(replace(problem, capacity={}))
    assert sum(a.instances for a in unlimited if a.region == "onprem:fra-dc1") > 1


def test_infeasible_capacity_names_the_quota(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    # Only H100 allowed, 40,000 tokens/s = 20 replicas = 20 GPUs (3 instances of 8); eu quotas give 16 + 8.
    d = dep("big", "eu", {"aws:eu-central-1": 40000.0}, rtt_objective_ms=30.0,
            allowed_skus=frozenset({"H100-80GB-SXM"}))
    capacity = {("gcp:europe-west4", "H100-80GB-SXM"): 0, ("gcp:europe-west1", "H100-80GB-SXM"): 0,
                ("aws:eu-central-1", "H100-80GB-SXM"): 8,
                ("onprem:fra-dc1", "H100-80GB-SXM"): 8}
    for options in (SolveOptions(), SolveOptions(joint_max_options=0)):  # whole and decomposed
        result = solve(Problem([d], offerings, regions, capacity=capacity), options)
        assert result.status == "infeasible"
        assert len(result.explanation) == 1
        line = result.explanation[0]
        assert line.startswith("capacity: H100-80GB-SXM in ") and "need 16 GPUs, quota 8 (deployments big)" in line


def test_only_providers_whose_drivers_are_enabled_are_planned(regions: dict[str, RegionInfo],
                                                               offerings: list[Offering]) -> None:
    d = dep("eu-chat", "eu", {"aws:eu-central-1": 3000.0}, rtt_objective_ms=30.0)
    everywhere = solved(Problem([d], offerings, regions))
    assert any(a.region.startswith("aws:") for a in everywhere)  # aws is in the plan when it may be
    for options in (EXACT, SolveOptions(joint_max_options=0)):  # whole and decomposed
        plan = solved(Problem([d], offerings, regions, providers=frozenset({"gcp", "onprem"})), options)
        assert {a.region.split(":")[0] for a in plan} == {"gcp", "onprem"}
    # The placement in force on aws is moved off it, not kept for its churn.
    onprem_only = Problem([replace(d, min_regions=1)], offerings, regions, current=tuple(everywhere),
                          providers=frozenset({"onprem"}))
    result = solve(onprem_only)
    assert result.feasible, result.explanation
    assert {a.region for a in result.assignments} == {"onprem:fra-dc1"}
    assert result.replicas_removed == sum(a.replicas for a in everywhere if a.region != "onprem:fra-dc1")
    # An independent check refuses a plan on a provider with no driver.
    assert any(line.startswith("provider: deployment eu-chat has replicas in aws:eu-central-1")
               for line in violations(onprem_only, everywhere))


def test_a_deployment_only_disabled_providers_could_serve_is_explained(regions: dict[str, RegionInfo],
                                                                       offerings: list[Offering]) -> None:
    d = dep("us-chat", "us", {"aws:us-east-1": 400.0}, rtt_objective_ms=30.0)
    result = solve(Problem([d], offerings, regions, providers=frozenset({"onprem"})))
    assert result.status == "infeasible" and not result.assignments
    assert result.explanation == (
        "deployment us-chat: no region of zone 'us' offers the allowed SKUs [H100-80GB-SXM, L4-24GB] within 30 ms"
        " of its client regions (not planned on aws, gcp: MERIDIAN_PROVIDER_ENABLED does not enable their drivers)",
    )


def test_spot_only_where_allowed(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    base = dep("s", "us", {"aws:us-east-1": 2000.0}, rtt_objective_ms=30.0)
    plan = solved(Problem([base], offerings, regions))
    assert not any(a.spot for a in plan)
    plan = solved(Problem([replace(base, spot_allowed=True)], offerings, regions))
    assert any(a.spot for a in plan) and all(a.region.startswith("aws:") for a in plan if a.spot)


def test_min_replicas_near_a_client(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    d = Deployment("r", SHAPES, zone="us", min_replicas_near={"aws:us-west-2": 5}, rtt_objective_ms=30.0)
    plan = solved(Problem([d], offerings, regions))
    assert sum(a.replicas for a in plan if a.region in {"aws:us-west-2", "gcp:us-west1"}) >= 5


def test_no_demand_still_gets_spread(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    plan = solved(Problem([Deployment("idle", SHAPES, zone="eu")], offerings, regions))
    assert len({a.region for a in plan}) == 2 and sum(a.replicas for a in plan) == 2


def test_costs_add_up(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    problem = Problem([dep("a", "us", {"aws:us-east-1": 900.0}), dep("b", "eu", {"aws:eu-central-1": 700.0})],
                      offerings, regions)
    result = solve(problem, EXACT)
    assert result.status == "optimal" and result.mip_gap <= 1e-9
    assert result.total_cost_per_hour == pytest.approx(sum(result.cost_per_deployment.values()))
    assert result.total_cost_per_hour == pytest.approx(sum(a.cost_per_hour for a in result.assignments))
    assert result.replicas_added == sum(a.replicas for a in result.assignments) and result.replicas_removed == 0


def _fleet(regions: dict[str, RegionInfo], seed: int, n: int) -> list[Deployment]:
    rng = random.Random(seed)
    zones = {"us": ["aws:us-east-1", "aws:us-east-2", "gcp:us-east4", "aws:us-west-2", "gcp:us-west1"],
             "eu": ["aws:eu-central-1", "gcp:europe-west4", "gcp:europe-west1", "onprem:fra-dc1"]}
    out = []
    for i in range(n):
        zone = rng.choice(["us", "eu", "global"])
        pool = zones["us"] + zones["eu"] if zone == "global" else zones[zone]
        clients = rng.sample(pool, k=rng.randint(1, 2))
        out.append(dep(f"d{i}", zone, {c: float(rng.randint(200, 9000)) for c in clients},
                       rtt_objective_ms=rng.choice([30.0, 80.0]), spot_allowed=rng.random() < 0.3))
    return out


def test_churn_after_region_loss_moves_only_the_lost_replicas(regions: dict[str, RegionInfo],
                                                              offerings: list[Offering]) -> None:
    problem = Problem(_fleet(regions, seed=3, n=12), offerings, regions,
                      capacity={("onprem:fra-dc1", "H100-80GB-SXM"): 16})
    for options in (EXACT, SolveOptions(joint_max_options=0)):
        plan = solved(problem, options)
        # Re-planning with nothing changed keeps every replica where it is.
        same = solve(replace(problem, current=tuple(plan)), options)
        assert same.churn == 0
        lost = "gcp:europe-west4"
        in_lost = sum(a.replicas for a in plan if a.region == lost)
        assert in_lost > 0
        survivors = [o for o in offerings if o.region != lost]
        after = solve(replace(problem, offerings=survivors, current=tuple(plan)), options)
        assert after.feasible and violations(replace(problem, offerings=survivors), list(after.assignments)) == []
        assert after.replicas_removed == in_lost
        kept = {a.key: a.replicas for a in after.assignments}
        for a in plan:
            if a.region != lost:
                assert kept.get(a.key, 0) >= a.replicas, a


def test_decomposition_agrees_with_the_whole_milp(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    capacity = {("onprem:fra-dc1", "H100-80GB-SXM"): 16, ("gcp:us-east4", "H100-80GB-SXM"): 16,
                ("gcp:us-east4", "L4-24GB"): 6}
    problem = Problem(_fleet(regions, seed=5, n=16), offerings, regions, capacity=capacity)
    whole = solve(problem, EXACT)
    parts = solve(problem, SolveOptions(joint_max_options=0))
    assert whole.status == "optimal" and parts.feasible
    assert violations(problem, list(parts.assignments)) == []
    # The decomposition's bound is valid: its gap covers the distance to the true optimum.
    assert parts.objective >= whole.objective - 1e-6
    assert (parts.objective - whole.objective) / parts.objective <= parts.mip_gap + 1e-9
    assert parts.objective <= whole.objective * 1.05


def test_real_catalog_smoke() -> None:
    from providers.catalog import load_catalog
    from providers.regions import region_catalog

    catalog, regions = load_catalog(), region_catalog()
    deployments = [
        Deployment("chat-8b", shapes_from_fit(fit_model(LLAMA_3_8B)), zone="eu",
                   demand_tokens_per_s={"aws:eu-central-1": 3000.0, "gcp:europe-west1": 1500.0}),
        Deployment("chat-70b", shapes_from_fit(fit_model(LLAMA_3_70B)), zone="us",
                   demand_tokens_per_s={"aws:us-east-1": 2000.0}, rtt_objective_ms=40.0),
    ]
    problem = Problem(deployments, catalog.offerings, regions)
    result = solve(problem)
    assert result.feasible, result.explanation
    assert violations(problem, list(result.assignments)) == []


def test_diff_reports_added_removed_changed() -> None:
    a = Assignment("d", "aws:us-east-1", "g6.xlarge", "L4-24GB", 2, 2, cost_per_hour=1.6)
    b = Assignment("d", "gcp:us-east4", "g2-standard-4", "L4-24GB", 1, 1, cost_per_hour=0.7)
    c = Assignment("d", "gcp:us-east4", "a3-highgpu-1g", "H100-80GB-SXM", 1, 1, cost_per_hour=5.0)
    change = diff([a, b], [replace(a, instances=3, replicas=3, cost_per_hour=2.4), c])
    assert [(x.region, x.instance_type, x.kind) for x in change.added] == [("gcp:us-east4", "a3-highgpu-1g", "added")]
    assert [(x.instance_type, x.instances_before, x.instances_after) for x in change.removed] == [
        ("g2-standard-4", 1, 0)]
    assert [(x.instance_type, x.replicas_before, x.replicas_after) for x in change.changed] == [("g6.xlarge", 2, 3)]
    assert change.cost_delta_per_hour == pytest.approx(2.4 + 5.0 - 1.6 - 0.7)
    assert diff([a], [a]).empty
    # Spot and on-demand of the same instance type are different machines.
    assert not diff([a], [replace(a, spot=True)]).empty


def test_nothing_to_place(regions: dict[str, RegionInfo], offerings: list[Offering]) -> None:
    result = solve(Problem([], offerings, regions))
    assert result.status == "optimal" and result.assignments == () and result.total_cost_per_hour == 0
