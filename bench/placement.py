"""Placement solver: solve time for a fleet, cost against a brute-force optimum, churn after a region loss.

    python -m bench.placement [--full]

- solve_seconds_300_deployments: 300 deployments (7B/8B/13B/70B, zones us/eu/apac/global, 1-3 client
  regions with demand, spread 2) over every catalog region of AWS and GCP plus the on-prem sites,
  solved with the production options (10 s time limit, 0.5 % MIP gap, 2 threads). The baseline is
  the 10 s budget itself (not measured): ratio ≤ 1 meets the goal.
- cost_vs_bruteforce: total MILP cost against the total brute-force optimum over N random small
  instances (zones, RTT, quotas, spot, spread), both solved exactly (MIP gap 0).
- churn_after_region_loss: the 300-deployment plan re-solved after the region holding the most
  replicas is lost: replicas moved (taken from where they were, the lost ones included) against the
  replicas that were in the lost region; 1 means only those moved.
- placement_3000_s and placement_3000_gap (issue 34): the same fleet at 3,000 deployments (cloud
  quotas scaled by 3,000/300, on-prem capacity as the inventory has it), solved with a 45 s time
  limit (SCALE_TIME_LIMIT_S); the baseline is the 60 s goal (not measured), and the gap is against the proven lower bound
  (`scale_point`, which bench.scale calls too). The quick form runs 1,000 deployments and says so
  in its goal; --full runs 300, 1,000 and 3,000.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, replace

from bench.common import Figure
from control_plane.placement import (
    Deployment,
    PlacementResult,
    Problem,
    ReplicaShape,
    SolveOptions,
    fit_model,
    shapes_from_fit,
    solve,
)
from control_plane.placement.bruteforce import TooLarge, solve_bruteforce
from control_plane.placement.candidates import build_candidates
from control_plane.placement.check import violations
from control_plane.placement.models import LLAMA_2_13B, LLAMA_3_8B, LLAMA_3_70B, MISTRAL_7B
from meridian.contracts import RegionInfo
from providers.catalog import Catalog, load_catalog
from providers.offerings import Offering
from providers.regions import region_catalog

BENCH = "placement"
# Cloud quotas per (region, SKU) in GPUs, as an account would have them: scarce for the big parts.
CLOUD_QUOTA = {"H100-80GB-SXM": 64, "H200-141GB": 32, "A100-80GB": 64, "A100-40GB": 96}
DEFAULT_CLOUD_QUOTA = 256
MODEL_MIX = [(LLAMA_3_8B, 0.35, (300, 3000)), (MISTRAL_7B, 0.2, (300, 3000)),
             (LLAMA_2_13B, 0.2, (200, 2000)), (LLAMA_3_70B, 0.25, (100, 1200))]
ZONE_MIX = [("us", 0.35), ("eu", 0.25), ("apac", 0.15), ("global", 0.25)]
FLEET = 300  # deployments the quotas are sized for
SCALE_GOAL_S = 60.0  # issue 34: 3,000 deployments placed within a minute
# The solver's time limit for the scale points: a quarter of the goal is left for what runs past the
# limit (the last MILPs, trimming and checking the plan), which grows with the fleet and the load.
SCALE_TIME_LIMIT_S = 45.0
SCALE_POINTS = (300, 1000, 3000)
QUICK_SCALE_POINT = 1000


@dataclass(frozen=True, slots=True)
class PlacementScalePoint:
    """One fleet size solved: wall seconds, the plan's cost and objective, the proven lower bound on
    the objective and the relative gap to it, the catalog regions used, and how it was solved."""

    n_deployments: int
    seconds: float
    gap: float
    cost: float
    objective: float
    lower_bound: float
    n_regions: int
    method: str
    status: str
    notes: tuple[str, ...] = ()  # the solver's: quota repairs, plans rounded from the LP


def scale_point(n_deployments: int, seed: int = 7, time_limit_s: float = SCALE_TIME_LIMIT_S) -> PlacementScalePoint:
    """Place `n_deployments` of the bench fleet (see `fleet_problem`) with the production options but
    a `time_limit_s` limit; the plan is checked against every hard rule (AssertionError otherwise)."""
    problem = fleet_problem(n_deployments, seed)
    t0 = time.perf_counter()
    plan = solve(problem, SolveOptions(time_limit_s=time_limit_s))
    seconds = time.perf_counter() - t0
    broken = violations(problem, list(plan.assignments)) if plan.feasible else list(plan.explanation)
    if not plan.feasible or broken:
        raise AssertionError(f"{n_deployments} deployments: {plan.status}: {broken[:3]}")
    options = SolveOptions()
    whole = sum(len(c.options) for c in build_candidates(problem)[0]) <= options.joint_max_options
    method = "one MILP" if whole else "per-deployment MILPs with LP quota prices, then quota repair"
    return PlacementScalePoint(
        n_deployments, seconds, plan.mip_gap, plan.total_cost_per_hour, plan.objective, plan.lower_bound,
        len({a.region for a in plan.assignments}), method, plan.status, plan.notes,
    )


def fleet_quotas(catalog: Catalog, n: int = FLEET) -> dict[tuple[str, str], int]:
    """Quotas for a fleet of n deployments: cloud quotas sized for 300 deployments grow with the fleet
    (× n/300 above 300: an account's quotas grow with what it runs); on-prem capacity is the
    inventory's hosts whatever n."""
    quotas: dict[tuple[str, str], int] = {}
    for o in catalog.offerings:
        site = catalog.gpu_capacity(o.region, o.sku)
        if site is not None:
            quotas[(o.region, o.sku)] = site
        else:
            quotas[(o.region, o.sku)] = CLOUD_QUOTA.get(o.sku, DEFAULT_CLOUD_QUOTA) * max(n, FLEET) // FLEET
    return quotas


def fleet_problem(n: int = 300, seed: int = 7) -> Problem:
    """n deployments over the whole catalog, with `fleet_quotas`; each deployment passes the pre-checks on its own."""
    catalog = load_catalog()
    regions = region_catalog()
    rng = random.Random(seed)
    shapes = {m.name: shapes_from_fit(fit_model(m)) for m, _, _ in MODEL_MIX}
    quotas = fleet_quotas(catalog, n)
    offered = sorted(catalog.regions())
    deployments: list[Deployment] = []
    while len(deployments) < n:
        model, _, (lo, hi) = rng.choices(MODEL_MIX, weights=[w for _, w, _ in MODEL_MIX])[0]
        zone = rng.choices([z for z, _ in ZONE_MIX], weights=[w for _, w in ZONE_MIX])[0]
        pool = [r for r in offered if zone == "global" or zone in regions[r].zones]
        clients = rng.sample(pool, k=min(len(pool), rng.randint(1, 3)))
        d = Deployment(
            name=f"{model.name}-{zone}-{len(deployments):03d}",
            shapes=shapes[model.name],
            zone=zone,
            demand_tokens_per_s={c: float(rng.randint(lo, hi)) for c in clients},
            rtt_objective_ms=rng.choice([40.0, 60.0, 80.0]),
            spot_allowed=rng.random() < 0.3,
        )
        _, errors = build_candidates(Problem([d], catalog.offerings, regions, quotas))
        if not errors:  # an impossible deployment measures nothing; draw another
            deployments.append(d)
    return Problem(deployments, catalog.offerings, regions, quotas)


def _small_regions(rng: random.Random) -> dict[str, RegionInfo]:
    """3-4 regions of two or three providers, in two zones, a few hundred km to a continent apart."""
    out = {}
    for i in range(rng.randint(3, 4)):
        provider = ("aws", "gcp", "onprem")[rng.randrange(3) if i > 1 else i]
        zone = rng.choice(["eu", "us"])
        base = (50.0, 8.0) if zone == "eu" else (40.0, -80.0)
        name = f"{provider}:r{i}"
        out[name] = RegionInfo(name=name, provider=provider, location=f"r{i}", zones=[zone],
                               latitude=base[0] + rng.uniform(-6, 6), longitude=base[1] + rng.uniform(-8, 8))
    return out


def small_problem(rng: random.Random) -> Problem:
    """A random instance small enough for the brute-force solver."""
    regions = _small_regions(rng)
    skus = {"S1": 1, "S2": 2}  # SKU → GPUs per instance of its offerings
    offerings = []
    for r, info in regions.items():
        for sku in rng.sample(sorted(skus), k=rng.randint(1, 2)):
            price = round(rng.uniform(1.0, 10.0), 2)
            spot = round(price * rng.uniform(0.3, 0.9), 2) if rng.random() < 0.3 else None
            offerings.append(Offering(info.provider, r, f"{sku.lower()}.x{skus[sku]}", sku, skus[sku], 8, 64,
                                      price, spot))
    deployments = []
    for i in range(rng.randint(1, 3)):
        shapes = {"S1": ReplicaShape(1, rng.uniform(150, 400)), "S2": ReplicaShape(2, rng.uniform(300, 900))}
        clients = rng.sample(sorted(regions), k=rng.randint(1, 2))
        deployments.append(Deployment(
            name=f"d{i}", shapes=shapes, zone=rng.choice(["eu", "us", "global"]),
            demand_tokens_per_s={c: float(rng.randint(50, 600)) for c in clients},
            rtt_objective_ms=rng.choice([15.0, 40.0, 200.0]),
            min_regions=rng.choice([1, 2]), spot_allowed=rng.random() < 0.5,
        ))
    capacity = {(o.region, o.sku): rng.randint(0, 8) for o in offerings if rng.random() < 0.4}
    return Problem(deployments, offerings, regions, capacity)


def _costs_agree(milp: PlacementResult, brute: PlacementResult) -> bool:
    if milp.feasible != brute.feasible:
        return False
    return not milp.feasible or abs(milp.objective - brute.objective) <= 1e-6 * max(1.0, brute.objective)


def cost_vs_bruteforce(instances: int, seed: int = 11) -> tuple[float, float, int]:
    """(total MILP cost, total optimum, instances compared) over feasible random small instances."""
    rng = random.Random(seed)
    exact = SolveOptions(mip_rel_gap=0.0)
    ours = best = 0.0
    compared = 0
    while compared < instances:
        problem = small_problem(rng)
        try:
            brute = solve_bruteforce(problem, max_configs=20_000)
        except TooLarge:
            continue  # too many configurations to enumerate quickly: draw another
        milp = solve(problem, exact)
        if not _costs_agree(milp, brute):
            raise AssertionError(f"MILP {milp.status} {milp.objective} != brute force {brute.status} {brute.objective}")
        if brute.feasible:
            ours += milp.total_cost_per_hour
            best += brute.total_cost_per_hour
            compared += 1
    return ours, best, compared


def region_loss(problem: Problem, plan: PlacementResult) -> tuple[str, int, PlacementResult]:
    """Lose the region holding the most replicas; re-plan from `plan`. (lost region, its replicas, new plan)."""
    held: dict[str, int] = {}
    for a in plan.assignments:
        held[a.region] = held.get(a.region, 0) + a.replicas
    lost = max(sorted(held), key=lambda r: held[r])
    survivors = [o for o in problem.offerings if o.region != lost]
    replanned = solve(replace(problem, offerings=survivors, current=plan.assignments))
    return lost, held[lost], replanned


def scale_figures(full: bool) -> list[Figure]:
    """placement_3000_s and its gap; quick: 1,000 deployments (the figure says so in its goal)."""
    points = [scale_point(n) for n in (SCALE_POINTS if full else (QUICK_SCALE_POINT,))]
    for p in points:
        print(f"# scale: {p.n_deployments} deployments: {p.seconds:.1f} s, gap {p.gap:.2%}, {p.cost:.0f} USD/h,"
              f" lower bound {p.lower_bound:.0f}, {p.n_regions} regions, {p.status}; {p.method};"
              f" {'; '.join(p.notes)}",
              file=sys.stderr, flush=True)
    last = points[-1]
    quick = "" if last.n_deployments == 3000 else f" (quick form: {last.n_deployments} deployments, not 3,000)"
    gap = last.gap if math.isfinite(last.gap) else 1.0
    return [
        Figure(BENCH, "placement_3000_s", last.seconds, SCALE_GOAL_S, "goal", f"<= 60{quick}", "s"),
        Figure(BENCH, "placement_3000_gap", gap, 1.0, "gap against the proven lower bound (1 = no bound)",
               f"reported{quick}", "fraction"),
    ]


def run(full: bool = False) -> list[Figure]:
    problem = fleet_problem()
    t0 = time.perf_counter()
    plan = solve(problem)
    seconds = time.perf_counter() - t0
    if not plan.feasible or violations(problem, list(plan.assignments)):
        raise AssertionError(f"fleet plan is not valid: {plan.status} {plan.explanation}")
    ours, best, n = cost_vs_bruteforce(100 if full else 25)
    lost, lost_replicas, replanned = region_loss(problem, plan)
    if not replanned.feasible:
        raise AssertionError(f"re-plan after losing {lost} failed: {replanned.explanation}")
    options = SolveOptions()
    print(f"# fleet: {len(problem.deployments)} deployments, {len(problem.offerings)} offerings in"
          f" {len({o.region for o in problem.offerings})} regions; {plan.status} in {seconds:.2f} s, gap"
          f" {plan.mip_gap:.2%} (limits: {options.time_limit_s:g} s, MIP gap {options.mip_rel_gap:.1%}),"
          f" {plan.total_cost_per_hour:.0f} USD/h; re-plan after losing {lost}: {replanned.solve_seconds:.2f} s,"
          f" gap {replanned.mip_gap:.2%}, +{replanned.replicas_added}/-{replanned.replicas_removed} replicas",
          file=sys.stderr, flush=True)
    budget = options.time_limit_s
    return [
        Figure(BENCH, "solve_seconds_300_deployments", seconds, budget, "time budget (10 s on 2 cores, not measured)",
               "<= 10", "s"),
        Figure(BENCH, "cost_vs_bruteforce", ours, best, f"brute-force optimum over {n} small instances",
               "= 1", "USD/h"),
        Figure(BENCH, "churn_after_region_loss", float(replanned.replicas_removed), float(lost_replicas),
               f"replicas in the lost region ({lost})", "<= 1", "replicas"),
        *scale_figures(full),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true",
                    help="100 brute-force instances instead of 25; 300, 1,000 and 3,000 deployments instead of 1,000")
    args = ap.parse_args()
    for fig in run(args.full):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
