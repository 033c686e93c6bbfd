"""Independent checks of a plan against a problem's hard rules (residency, enabled providers, RTT,
demand, spread, quotas).

The solver asserts residency with these after every solve; tests and the brute-force reference
use them to judge any plan without trusting the MILP.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations

from control_plane.placement.problem import Assignment, Deployment, Problem, rtt_ms, usable_offerings
from providers.offerings import Offering

_TOL = 1e-6


def residency_violations(problem: Problem, assignments: Iterable[Assignment]) -> list[str]:
    """One line per assignment of a zoned deployment outside its zone (or in an unknown region)."""
    zones = {d.name: d.zone for d in problem.deployments}
    out = []
    for a in assignments:
        region = problem.regions.get(a.region)
        zone = zones.get(a.deployment, "?")
        if region is None or not region.admits(zone):
            out.append(f"residency: deployment {a.deployment} (zone '{zone}') has replicas in {a.region}")
    return out


def provider_violations(problem: Problem, assignments: Iterable[Assignment]) -> list[str]:
    """One line per assignment in a region whose provider the control plane cannot provision."""
    out = []
    for a in assignments:
        region = problem.regions.get(a.region)
        if region is not None and not problem.provisions(region):
            out.append(f"provider: deployment {a.deployment} has replicas in {a.region}, whose provider"
                       f" {region.provider} has no enabled driver")
    return out


def demand_coverable(demand: Mapping[str, float], supply: Mapping[str, float],
                     reach: Mapping[str, Sequence[str]]) -> str | None:
    """None when supply per region can carry each client's demand over its reachable regions; else a client set that cannot be served.

    Exact by Gale/Hall: a transport plan exists iff every set S of clients demands no more than
    the regions reachable from S supply (max-flow = min-cut with uncapacitated middle edges).
    """
    clients = [c for c, v in demand.items() if v > 0]
    for k in range(1, len(clients) + 1):
        for subset in combinations(clients, k):
            need = sum(demand[c] for c in subset)
            regions = {r for c in subset for r in reach.get(c, ())}
            have = sum(supply.get(r, 0.0) for r in regions)
            if need > have * (1 + _TOL) + _TOL:
                return f"{list(subset)} need {need:.1f} tokens/s, reachable replicas serve {have:.1f}"
    return None


def effective_min_providers(problem: Problem, d: Deployment) -> int:
    """The deployment's provider spread requirement (explicit, or 2 capped by the providers available)."""
    if d.min_providers is not None:
        return d.min_providers
    providers = set()
    for usable in usable_offerings(problem, d):
        off = usable.offering
        priced = off.price_per_hour is not None or (d.spot_allowed and off.spot_price_per_hour is not None)
        quota = problem.capacity.get((off.region, off.sku))
        if priced and (quota is None or quota >= off.gpu_count):
            providers.add(usable.region.provider)
    return min(2, max(1, len(providers)))


def violations(problem: Problem, assignments: Sequence[Assignment]) -> list[str]:
    """Every hard rule the plan breaks, one line each; empty for a valid plan."""
    out = residency_violations(problem, assignments) + provider_violations(problem, assignments)
    offerings = {(o.region, o.instance_type): o for o in problem.offerings}
    by_dep: dict[str, list[Assignment]] = defaultdict(list)
    gpus: dict[tuple[str, str], int] = defaultdict(int)
    for a in assignments:
        by_dep[a.deployment].append(a)
        off = offerings.get((a.region, a.instance_type))
        if off is None or off.sku != a.sku:
            out.append(f"offering: {a.instance_type} ({a.sku}) is not sold in {a.region}")
            continue
        gpus[(a.region, a.sku)] += a.instances * off.gpu_count
    for (region, sku), used in sorted(gpus.items()):
        quota = problem.capacity.get((region, sku))
        if quota is not None and used > quota:
            out.append(f"capacity: {sku} in {region}: plan uses {used} GPUs, quota {quota}")

    for d in problem.deployments:
        out.extend(deployment_violations(problem, d, by_dep.get(d.name, []), offerings))
    return out


def deployment_violations(
    problem: Problem,
    d: Deployment,
    assignments: Sequence[Assignment],
    offerings: Mapping[tuple[str, str], Offering],
    min_providers: int | None = None,
) -> list[str]:
    """The rules one deployment's assignments break (all but residency and shared quotas).

    `offerings` is keyed by (region, instance type); `min_providers` defaults to
    effective_min_providers (which scans the offerings: pass it when calling often)."""
    out: list[str] = []
    supply: dict[str, float] = defaultdict(float)
    replicas: dict[str, int] = defaultdict(int)
    instances: dict[str, int] = defaultdict(int)
    for a in assignments:
        off = offerings.get((a.region, a.instance_type))
        shape = d.shapes.get(a.sku)
        if shape is None or (d.allowed_skus is not None and a.sku not in d.allowed_skus):
            out.append(f"sku: deployment {d.name} may not run on {a.sku}")
            continue
        if off is None:
            continue
        if a.spot and not d.spot_allowed:
            out.append(f"spot: deployment {d.name} has spot instances in {a.region}")
        if a.replicas != a.instances * (off.gpu_count // shape.tp) or a.replicas <= 0:
            out.append(f"fit: deployment {d.name}: {a.instances} × {a.instance_type} do not hold {a.replicas}"
                       f" replicas of TP {shape.tp}")
        supply[a.region] += a.replicas * shape.tokens_per_s
        replicas[a.region] += a.replicas
        instances[a.region] += a.instances
    if d.disaggregated:
        for r, n in sorted(instances.items()):
            if n < 2:
                out.append(f"pools: deployment {d.name} has {n} instance in {r}; a disaggregated region needs"
                           " a prefill and a decode node")
    clients = d.client_regions
    reach = {c: [r for r in replicas
                 if r in problem.regions and rtt_ms(problem.regions[c], problem.regions[r]) <= d.rtt_objective_ms]
             for c in clients}
    if clients:
        far = sorted(r for r in replicas if not any(r in rs for rs in reach.values()))
        if far:
            out.append(f"rtt: deployment {d.name} has replicas in {far}, beyond {d.rtt_objective_ms:g} ms"
                       " of every client region")
    short = demand_coverable(d.demand_tokens_per_s, supply, reach)
    if short:
        out.append(f"demand: deployment {d.name}: {short}")
    for c, count in d.min_replicas_near.items():
        have = sum(replicas[r] for r in reach.get(c, ()))
        if have < count:
            out.append(f"replicas: deployment {d.name}: {have} replicas near {c}, {count} requested")
    if len(replicas) < d.min_regions:
        out.append(f"spread: deployment {d.name} is in {len(replicas)} regions, requires {d.min_regions}")
    providers = {problem.regions[r].provider for r in replicas if r in problem.regions}
    need_providers = min_providers if min_providers is not None else effective_min_providers(problem, d)
    if len(providers) < need_providers:
        out.append(f"spread: deployment {d.name} is on {len(providers)} providers, requires {need_providers}")
    return out
