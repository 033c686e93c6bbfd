"""Pre-filtering for the solver: per deployment, the regions and instance options worth a variable,
and the cheap feasibility checks that explain an impossible problem before any MILP runs.

Pruning (all of it keeps at least one optimal plan):
- residency: only regions whose zones contain the deployment's zone (never a variable outside);
- provisioning: only regions of the providers whose drivers the control plane runs
  (`Problem.providers`), so no plan holds a group the reconciler could never create; when that
  leaves a deployment nowhere to go, the explanation names the providers left out;
- RTT: with client regions, only regions within the RTT objective of at least one of them;
- fit: only SKUs the model fits on and the deployment allows, and instances with at least TP GPUs;
- price: per (region, SKU, GPU count, spot) the cheapest instance type; then an option is dominated
  when another of the same region and SKU hosts a divisor of its replica count with proportionally
  no more price and no more GPUs (q copies of it are as good). Options in the current placement
  are kept, so keeping a replica where it is stays possible.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from control_plane.placement.problem import Deployment, Problem, rtt_ms
from providers.offerings import Offering


@dataclass(frozen=True, slots=True)
class Option:
    """One way to buy replicas of a deployment: an offering, on-demand or spot."""

    offering: Offering
    spot: bool
    price: float  # USD per instance-hour
    replicas: int  # replicas per instance
    tokens_per_s: float  # per instance
    max_useful: int  # more instances never help: they alone cover all the demand they can reach

    @property
    def region(self) -> str:
        return self.offering.region

    @property
    def sku(self) -> str:
        return self.offering.sku

    @property
    def gpus(self) -> int:
        return self.offering.gpu_count

    @property
    def key(self) -> tuple[str, str, str, bool]:
        """(region, instance type, SKU, spot): an assignment's key without the deployment."""
        return (self.offering.region, self.offering.instance_type, self.offering.sku, self.spot)


@dataclass(frozen=True, slots=True)
class Candidates:
    """What the solver may use for one deployment."""

    deployment: Deployment
    options: tuple[Option, ...]
    regions: tuple[str, ...]  # candidate regions with at least one option, sorted
    reach: dict[str, tuple[str, ...]]  # client region → candidate regions within the RTT objective
    providers: tuple[str, ...]  # providers of the candidate regions, sorted
    min_regions: int
    min_providers: int


def _fmt(names: list[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(names) + "]"


def _dominates(a: Option, b: Option) -> bool:
    """Whether q instances of `a` replace one of `b` at no more price and no more GPUs."""
    if a is b or b.replicas % a.replicas:
        return False
    q = b.replicas // a.replicas
    cheaper = q * a.price < b.price or (q * a.price == b.price and (q, a.key) < (1, b.key))
    return cheaper and q * a.gpus <= b.gpus


def _prune(options: list[Option], keep: set[tuple[str, str, str, bool]]) -> list[Option]:
    """Drop dominated options within one (region, SKU); options whose key is in `keep` stay."""
    cheapest: dict[tuple[int, bool], Option] = {}
    for o in options:
        k = (o.gpus, o.spot)
        if k not in cheapest or (o.price, o.key) < (cheapest[k].price, cheapest[k].key):
            cheapest[k] = o
    survivors = list(cheapest.values())
    pruned = [o for o in survivors if not any(_dominates(a, o) for a in survivors)]
    kept = {o.key for o in pruned}
    return pruned + [o for o in options if o.key in keep and o.key not in kept]


def build_candidates(problem: Problem) -> tuple[list[Candidates], list[str]]:
    """Candidates per deployment (in problem order), and explanations of what makes the problem infeasible."""
    by_region: dict[str, list[Offering]] = defaultdict(list)
    for off in problem.offerings:
        if off.region in problem.regions:
            by_region[off.region].append(off)
    current_keys: dict[str, set[tuple[str, str, str, bool]]] = defaultdict(set)
    current_instances: dict[tuple[str, str, str, str, bool], int] = defaultdict(int)
    for a in problem.current:
        current_keys[a.deployment].add(a.key[1:])
        current_instances[a.key] += a.instances
    rtt_cache: dict[tuple[str, str], float] = {}

    def rtt(c: str, r: str) -> float:
        if (c, r) not in rtt_cache:
            rtt_cache[(c, r)] = rtt_ms(problem.regions[c], problem.regions[r])
        return rtt_cache[(c, r)]

    out: list[Candidates] = []
    errors: list[str] = []
    for d in problem.deployments:
        skus = d.usable_skus()
        if not skus:
            allowed = sorted(d.allowed_skus or ())
            errors.append(f"deployment {d.name}: the model fits none of the allowed SKUs {_fmt(allowed)}"
                          f" (it fits {_fmt(sorted(d.shapes))})")
            out.append(Candidates(d, (), (), {}, (), d.min_regions, d.min_providers or 1))
            continue
        clients = d.client_regions
        zone_regions = [r for r in sorted(problem.regions) if problem.regions[r].admits(d.zone)]
        if clients:
            allowed_regions = [r for r in zone_regions if any(rtt(c, r) <= d.rtt_objective_ms for c in clients)]
        else:
            allowed_regions = zone_regions
        # Providers that sell the deployment a fitting SKU here but whose drivers are not enabled.
        disabled = sorted({problem.regions[r].provider for r in allowed_regions
                           if not problem.provisions(problem.regions[r])
                           and any(off.sku in skus for off in by_region.get(r, ()))})

        options: list[Option] = []
        no_quota: set[str] = set()
        for r in allowed_regions:
            if not problem.provisions(problem.regions[r]):
                continue
            reach_demand = sum(v for c, v in d.demand_tokens_per_s.items() if rtt(c, r) <= d.rtt_objective_ms)
            reach_count = max(
                (v for c, v in d.min_replicas_near.items() if rtt(c, r) <= d.rtt_objective_ms), default=0
            )
            groups: dict[str, list[Option]] = defaultdict(list)
            for off in by_region.get(r, ()):
                shape = d.shapes.get(off.sku)
                if off.sku not in skus or shape is None or off.gpu_count < shape.tp:
                    continue
                replicas = off.gpu_count // shape.tp
                tokens = replicas * shape.tokens_per_s
                quota = problem.capacity.get((r, off.sku))
                for spot, price in ((False, off.price_per_hour), (True, off.spot_price_per_hour)):
                    if price is None or (spot and not d.spot_allowed):
                        continue
                    if quota is not None and quota < off.gpu_count:
                        no_quota.add(r)  # not even one instance fits the quota
                        continue
                    held = current_instances.get((d.name, r, off.instance_type, off.sku, spot), 0)
                    # A disaggregated region holds two instances at least (a prefill and a decode node).
                    least = 2 if d.disaggregated else 1
                    useful = max(least, math.ceil(reach_demand / tokens), math.ceil(reach_count / replicas), held)
                    groups[off.sku].append(Option(off, spot, price, replicas, tokens, useful))
            for group in groups.values():
                options.extend(_prune(group, current_keys.get(d.name, set())))

        regions = tuple(sorted({o.region for o in options}))
        reach = {c: tuple(r for r in regions if rtt(c, r) <= d.rtt_objective_ms) for c in clients}
        providers = tuple(sorted({problem.regions[r].provider for r in regions}))
        min_providers = d.min_providers if d.min_providers is not None else min(2, max(1, len(providers)))
        cand = Candidates(d, tuple(options), regions, reach, providers, d.min_regions, min_providers)
        out.append(cand)
        errors.extend(_precheck(cand, skus, sorted(no_quota - set(regions)), disabled))
    return out, errors


def _notes(quota_zero: list[str], disabled: list[str]) -> str:
    """What left regions out, for an explanation: quotas of 0 and providers not enabled."""
    notes = [f"quota 0 in {_fmt(quota_zero)}"] if quota_zero else []
    if disabled:
        notes.append(f"not planned on {', '.join(disabled)}: MERIDIAN_PROVIDER_ENABLED does not enable"
                     f" {'their drivers' if len(disabled) > 1 else 'its driver'}")
    return f" ({'; '.join(notes)})" if notes else ""


def _precheck(c: Candidates, skus: list[str], quota_zero: list[str], disabled: list[str]) -> list[str]:
    """Reasons one deployment alone cannot be placed, whatever the others do."""
    d = c.deployment
    where = f"zone '{d.zone}'"
    note = _notes(quota_zero, disabled)
    near = f" within {d.rtt_objective_ms:g} ms of its client regions" if d.client_regions else ""
    errors: list[str] = []
    if not c.regions:
        return [f"deployment {d.name}: no region of {where} offers the allowed SKUs {_fmt(skus)}{near}{note}"]
    for client, regions in c.reach.items():
        if not regions:
            errors.append(f"deployment {d.name}: no region of {where} offering the allowed SKUs {_fmt(skus)}"
                          f" within {d.rtt_objective_ms:g} ms of client region {client}{note}")
    if len(c.regions) < c.min_regions:
        n = len(c.regions)
        errors.append(f"deployment {d.name}: {where} has only {n} region{'s' * (n != 1)} {_fmt(c.regions)}"
                      f" offering the allowed SKUs {_fmt(skus)}{near}, spread requires {c.min_regions}{note}")
    if len(c.providers) < c.min_providers:
        errors.append(f"deployment {d.name}: the regions of {where} offering the allowed SKUs{near} span only the"
                      f" providers {_fmt(c.providers)}, spread requires {c.min_providers}{note}")
    return errors

