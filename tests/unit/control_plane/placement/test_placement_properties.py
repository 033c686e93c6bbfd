"""Property tests: on random small worlds (zones, demands, quotas, spot, spread), every plan keeps
residency, spread and quotas, and the MILP's objective equals the brute-force optimum."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from control_plane.placement.bruteforce import TooLarge, solve_bruteforce
from control_plane.placement.candidates import build_candidates
from control_plane.placement.check import deployment_violations, violations
from control_plane.placement.model import CurrentPlan, PlacementModel
from control_plane.placement.problem import Deployment, Problem, ReplicaShape, SolveOptions
from control_plane.placement.solver import _objective, solve
from meridian.contracts import RegionInfo
from providers.offerings import Offering

# A pool of sites (provider, zone, latitude, longitude): near neighbours and far ones, three providers.
_SITES = [
    ("aws", "eu", 50.1, 8.7), ("gcp", "eu", 50.4, 3.8), ("onprem", "eu", 48.9, 2.3), ("gcp", "eu", 59.3, 18.1),
    ("aws", "us", 38.9, -77.4), ("gcp", "us", 41.3, -95.9), ("onprem", "us", 40.7, -74.0),
    ("aws", "apac", 35.7, 139.7), ("gcp", "apac", 1.3, 103.8),
]
_SKUS = {"S1": 1, "S2": 2}  # SKU → GPUs per instance of its offerings
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    picks = draw(st.lists(st.integers(0, len(_SITES) - 1), min_size=2, max_size=4, unique=True))
    regions: dict[str, RegionInfo] = {}
    offerings: list[Offering] = []
    for i in sorted(picks):
        provider, zone, lat, lon = _SITES[i]
        name = f"{provider}:site{i}"
        # A second zone on some regions: a region may belong to several.
        zones = [zone] + (["eea"] if draw(st.booleans()) else [])
        regions[name] = RegionInfo(name=name, provider=provider, location=f"site{i}", zones=zones,  # type: ignore[arg-type]
                                   latitude=lat, longitude=lon)
        for sku in draw(st.lists(st.sampled_from(sorted(_SKUS)), min_size=1, max_size=2, unique=True)):
            price = draw(st.integers(10, 100)) / 10
            spot = draw(st.one_of(st.none(), st.integers(3, 9).map(lambda f, p=price: round(p * f / 10, 2))))
            offerings.append(Offering(provider, name, f"{sku.lower()}.x{_SKUS[sku]}", sku, _SKUS[sku], 8, 64,
                                      price, spot))
    names = sorted(regions)
    deployments = []
    for j in range(draw(st.integers(1, 2))):
        clients = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
        deployments.append(Deployment(
            name=f"d{j}",
            shapes={"S1": ReplicaShape(1, draw(st.integers(150, 400))), "S2": ReplicaShape(2, draw(st.integers(300, 900)))},
            zone=draw(st.sampled_from(["eu", "us", "apac", "eea", "global"])),
            demand_tokens_per_s={c: float(draw(st.integers(0, 600))) for c in clients},
            min_replicas_near=({clients[0]: draw(st.integers(1, 3))} if draw(st.booleans()) else {}),
            rtt_objective_ms=draw(st.sampled_from([15.0, 60.0, 250.0])),
            min_regions=draw(st.integers(1, 2)),
            spot_allowed=draw(st.booleans()),
        ))
    keys = sorted({(o.region, o.sku) for o in offerings})
    capacity = {k: draw(st.integers(0, 10)) for k in keys if draw(st.booleans())}
    return Problem(deployments, offerings, regions, capacity)


def _assert_valid(problem: Problem, options: SolveOptions) -> None:
    result = solve(problem, options)
    if not result.feasible:
        assert result.status == "infeasible" and result.explanation
        return
    zones = {d.name: d.zone for d in problem.deployments}
    for a in result.assignments:  # residency, spelled out
        assert problem.regions[a.region].admits(zones[a.deployment])
    assert violations(problem, list(result.assignments)) == []  # spread, quotas, demand, RTT, spot


@PROPERTY_SETTINGS
@given(problems())
def test_plans_keep_residency_spread_and_quotas(problem: Problem) -> None:
    _assert_valid(problem, SolveOptions())


@PROPERTY_SETTINGS
@given(problems())
def test_decomposed_plans_keep_residency_spread_and_quotas(problem: Problem) -> None:
    _assert_valid(problem, SolveOptions(joint_max_options=0))


@PROPERTY_SETTINGS
@given(problems())
def test_milp_cost_equals_bruteforce_optimum(problem: Problem) -> None:
    try:
        best = solve_bruteforce(problem, max_configs=20_000)
    except TooLarge:
        assume(False)
        return
    ours = solve(problem, SolveOptions(mip_rel_gap=0.0))
    assert ours.feasible == best.feasible, (ours.explanation, best.explanation)
    if best.feasible:
        assert abs(ours.objective - best.objective) <= 1e-6 * max(1.0, best.objective)
        assert abs(ours.total_cost_per_hour - best.total_cost_per_hour) <= 1e-6 * max(1.0, best.total_cost_per_hour)


@PROPERTY_SETTINGS
@given(problems())
def test_decomposed_lower_bound_is_at_most_the_optimum(problem: Problem) -> None:
    try:
        best = solve_bruteforce(problem, max_configs=20_000)
    except TooLarge:
        assume(False)
        return
    parts = solve(problem, SolveOptions(joint_max_options=0))
    assert parts.feasible == best.feasible
    if best.feasible:
        # The gap it reports is against a bound that no plan beats.
        assert parts.lower_bound <= best.objective + 1e-6 * max(1.0, best.objective)
        assert parts.objective >= best.objective - 1e-6 * max(1.0, best.objective)


@PROPERTY_SETTINGS
@given(problems())
def test_a_deployment_lp_relaxation_rounded_up_is_a_valid_plan(problem: Problem) -> None:
    cands, errors = build_candidates(problem)
    assume(not errors)
    current = CurrentPlan.of(problem)
    offerings = {(o.region, o.instance_type): o for o in problem.offerings}
    for cand in cands:
        model = PlacementModel(problem, current, [cand], problem.capacity)
        model.milp.integer = [0] * len(model.milp.integer)
        lp = model.milp.solve(5.0, 0.0)
        if not lp.has_solution:
            continue
        plan = model.read(lp, round_up=True)[0]
        assert deployment_violations(problem, cand.deployment, plan, offerings, cand.min_providers) == []
        # Its LP value bounds its cost from below.
        assert _objective(problem, current, [cand], [plan]) >= lp.objective - 1e-6
