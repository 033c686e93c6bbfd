"""Reference solver for small problems: exhaustive enumeration, no MILP, no pruning by dominance.

Each deployment's instance counts per option range over 0..bound, where more than the bound of an
option is never useful (it would alone cover all the demand and replica counts it can reach, or
break its quota), so the enumeration is exact. Deployments are then combined by depth-first
search with branch-and-bound under the shared quotas. It minimises the same objective as the
MILP (cost plus churn penalty) and judges plans with `check`, so it shares no code with the
solver's model. Exponential: meant for a handful of options per deployment.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from control_plane.placement.check import demand_coverable, effective_min_providers
from control_plane.placement.diff import churn_counts
from control_plane.placement.problem import (
    Assignment,
    Deployment,
    PlacementResult,
    Problem,
    SolveStatus,
    rtt_ms,
    usable_offerings,
)
from providers.offerings import Offering


class TooLarge(ValueError):
    """The instance is too big to enumerate."""


@dataclass(frozen=True, slots=True)
class _Choice:
    offering: Offering
    spot: bool
    price: float
    replicas: int
    tokens_per_s: float
    bound: int
    held: int  # instances of this exact choice in the current placement


@dataclass(frozen=True, slots=True)
class _Config:
    objective: float
    counts: tuple[int, ...]
    gpus: dict[tuple[str, str], int]


def _choices(problem: Problem, d: Deployment) -> list[_Choice]:
    held: dict[tuple[str, str, str, str, bool], int] = defaultdict(int)
    for a in problem.current:
        held[a.key] += a.instances
    out = []
    for usable in usable_offerings(problem, d):
        off, shape, near = usable.offering, usable.shape, usable.near
        replicas = off.gpu_count // shape.tp
        tokens = replicas * shape.tokens_per_s
        for spot, price in ((False, off.price_per_hour), (True, off.spot_price_per_hour)):
            if price is None or (spot and not d.spot_allowed):
                continue
            h = held.get((d.name, off.region, off.instance_type, off.sku, spot), 0)
            demand = sum(d.demand_tokens_per_s.get(c, 0.0) for c in near)
            count = max((d.min_replicas_near.get(c, 0) for c in near), default=0)
            bound = max(1, math.ceil(demand / tokens), math.ceil(count / replicas), h)
            quota = problem.capacity.get((off.region, off.sku))
            if quota is not None:
                bound = min(bound, quota // off.gpu_count)
            if bound > 0:
                out.append(_Choice(off, spot, price, replicas, tokens, bound, h))
    return out


def _feasible(problem: Problem, d: Deployment, choices: list[_Choice], counts: tuple[int, ...],
              min_providers: int) -> bool:
    supply: dict[str, float] = defaultdict(float)
    replicas: dict[str, int] = defaultdict(int)
    for ch, n in zip(choices, counts, strict=True):
        if n:
            supply[ch.offering.region] += n * ch.tokens_per_s
            replicas[ch.offering.region] += n * ch.replicas
    if len(replicas) < d.min_regions:
        return False
    if len({problem.regions[r].provider for r in replicas}) < min_providers:
        return False
    reach = {c: [r for r in replicas if rtt_ms(problem.regions[c], problem.regions[r]) <= d.rtt_objective_ms]
             for c in d.client_regions}
    if demand_coverable(d.demand_tokens_per_s, supply, reach) is not None:
        return False
    return all(sum(replicas[r] for r in reach.get(c, ())) >= n for c, n in d.min_replicas_near.items())


class _Search:
    """Depth-first over deployments, cheapest configuration first, pruned by a lower bound."""

    def __init__(self, problem: Problem, configs: list[list[_Config]]) -> None:
        self.capacity = problem.capacity
        self.configs = configs
        # Cheapest possible objective of the deployments from each depth on.
        self.rest = [0.0] * (len(configs) + 1)
        for i in range(len(configs) - 1, -1, -1):
            self.rest[i] = self.rest[i + 1] + configs[i][0].objective
        self.best_objective = math.inf
        self.best: list[_Config] = []
        self.used: dict[tuple[str, str], int] = defaultdict(int)
        self.picked: list[_Config] = []

    def dfs(self, i: int, partial: float) -> None:
        if i == len(self.configs):
            if partial < self.best_objective:
                self.best_objective, self.best = partial, list(self.picked)
            return
        for cfg in self.configs[i]:
            if partial + cfg.objective + self.rest[i + 1] >= self.best_objective - 1e-9:
                break  # configurations are sorted: none after this one does better
            if any(self.used[k] + g > self.capacity.get(k, math.inf) for k, g in cfg.gpus.items()):
                continue
            for k, g in cfg.gpus.items():
                self.used[k] += g
            self.picked.append(cfg)
            self.dfs(i + 1, partial + cfg.objective)
            self.picked.pop()
            for k, g in cfg.gpus.items():
                self.used[k] -= g


def solve_bruteforce(problem: Problem, max_configs: int = 200_000) -> PlacementResult:
    """The optimal placement by exhaustive search; raises TooLarge past `max_configs` per deployment."""
    t0 = time.perf_counter()
    in_current = {a.deployment for a in problem.current}
    per_dep: list[tuple[Deployment, list[_Choice], list[_Config]]] = []
    for d in problem.deployments:
        choices = _choices(problem, d)
        total = math.prod(ch.bound + 1 for ch in choices)
        if total > max_configs:
            raise TooLarge(f"deployment {d.name}: {total} configurations")
        churn = problem.churn_penalty if d.name in in_current else 0.0
        min_providers = effective_min_providers(problem, d)
        configs = []
        for counts in itertools.product(*(range(ch.bound + 1) for ch in choices)):
            if not _feasible(problem, d, choices, counts, min_providers):
                continue
            objective = sum(ch.price * (n + churn * abs(n - ch.held)) for ch, n in zip(choices, counts, strict=True))
            gpus: dict[tuple[str, str], int] = defaultdict(int)
            for ch, n in zip(choices, counts, strict=True):
                if n:
                    gpus[(ch.offering.region, ch.offering.sku)] += n * ch.offering.gpu_count
            configs.append(_Config(objective, counts, dict(gpus)))
        if not configs:
            return PlacementResult(SolveStatus.INFEASIBLE, explanation=(f"deployment {d.name}: no feasible configuration",),
                                   solve_seconds=time.perf_counter() - t0)
        configs.sort(key=lambda c: c.objective)
        per_dep.append((d, choices, configs))

    search = _Search(problem, [configs for _, _, configs in per_dep])
    search.dfs(0, 0.0)
    if search.best_objective == math.inf:
        return PlacementResult(SolveStatus.INFEASIBLE, explanation=("capacity: no combination fits the quotas",),
                               solve_seconds=time.perf_counter() - t0)
    assignments: list[Assignment] = []
    for (d, choices, _), cfg in zip(per_dep, search.best, strict=True):
        for ch, n in zip(choices, cfg.counts, strict=True):
            if n:
                off = ch.offering
                assignments.append(Assignment(d.name, off.region, off.instance_type, off.sku, n, n * ch.replicas,
                                              ch.spot, n * ch.price))
    added, removed = churn_counts(tuple(problem.current), assignments)
    costs = {d.name: 0.0 for d in problem.deployments}
    for a in assignments:
        costs[a.deployment] += a.cost_per_hour
    return PlacementResult(
        status=SolveStatus.OPTIMAL,
        assignments=tuple(assignments),
        total_cost_per_hour=sum(costs.values()),
        cost_per_deployment=costs,
        replicas_added=added,
        replicas_removed=removed,
        objective=search.best_objective,
        solve_seconds=time.perf_counter() - t0,
    )
