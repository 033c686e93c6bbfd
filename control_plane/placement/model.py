"""The placement MILP for a set of deployments: variables, constraints, and reading a plan back.

Variables, per deployment d (options come from `candidates`: residency and RTT filtered, pruned):
- n[d,o]  integer: instances of option o (an offering, on-demand or spot), 0 ≤ n ≤ its bound;
- f[d,c,r] ≥ 0: tokens/s of client region c's demand served by region r (r within RTT of c);
- y[d,r], z[d,p] binary: region r / provider p has a replica (spread indicators);
- add/rem ≥ 0: instances added to / removed from a current assignment (churn).
Constraints:
- demand:   Σ_r f[d,c,r] ≥ demand[d,c];   Σ_c f[d,c,r] ≤ Σ_{o in r} tokens_o · n[d,o];
- replicas: Σ_{r within RTT of c} Σ_o replicas_o · n[d,o] ≥ min_replicas_near[d,c];
- spread:   y[d,r] ≤ Σ_{o in r} n[d,o],  Σ_r y ≥ min_regions;  z[d,p] ≤ Σ_{r of p} y[d,r],  Σ_p z ≥ min_providers;
- capacity: Σ_{d,o in (region, SKU)} gpus_o · n[d,o] ≤ quota  (optionally elastic, with a slack);
- churn:    add − n ≥ −cur,  rem + n ≥ cur  (options in the current plan).
Objective: Σ (price + key_price) · n + churn_penalty · price · (instances added + removed), where
key_price is an optional price per GPU of a (region, SKU) (the Lagrangian price of its quota).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from control_plane.placement.candidates import Candidates, Option
from control_plane.placement.milp import Milp, MilpSolution
from control_plane.placement.problem import Assignment, Problem

Key = tuple[str, str]  # (region, SKU): what quotas are per
AssignmentKey = tuple[str, str, str, str, bool]

# Instance counts of an LP solution within this of an integer are that integer (HiGHS's feasibility tolerance).
_ROUND_TOL = 1e-6
# The elastic model minimises the GPUs over quota first; cost only breaks ties.
ELASTIC_COST_WEIGHT = 1e-6


@dataclass(frozen=True, slots=True)
class CurrentPlan:
    """The placement in force, indexed for the model builder."""

    deployments: frozenset[str]
    instances: Mapping[AssignmentKey, int]

    @classmethod
    def of(cls, problem: Problem) -> CurrentPlan:
        instances: dict[AssignmentKey, int] = defaultdict(int)
        for a in problem.current:
            instances[a.key] += a.instances
        return cls(frozenset(a.deployment for a in problem.current), dict(instances))


class PlacementModel:
    """The MILP over some deployments' candidates, with the columns needed to read a plan back.

    `capacity` gives the quota (GPUs) per key the model must respect — the problem's, or what is
    left of it by deployments outside the model; keys absent are unlimited. `key_price` adds a
    price per GPU of a key to the objective (Lagrangian prices of quotas), and `elastic` adds a
    slack per capacity row.
    """

    def __init__(
        self,
        problem: Problem,
        current: CurrentPlan,
        cands: Sequence[Candidates],
        capacity: Mapping[Key, int],
        *,
        key_price: Mapping[Key, float] | None = None,
        elastic: bool = False,
    ) -> None:
        self.cands = list(cands)
        self.milp = Milp()
        self.n: list[list[int]] = []  # per deployment, per option: column of n[d,o]
        self.capacity_slack: dict[Key, int] = {}
        self.capacity_rows: dict[Key, int] = {}
        # Per instance column: (column, option, unit price without a quota price, held today).
        self._instance_cols: list[tuple[int, Option, float, bool]] = []
        key_price = key_price or {}
        weight = ELASTIC_COST_WEIGHT if elastic else 1.0
        gpu_terms: dict[Key, list[tuple[int, float]]] = defaultdict(list)

        # Per deployment: its columns [first, end) and its slice of _instance_cols.
        self.block_cols: list[tuple[int, int]] = []
        self.block_instances: list[tuple[int, int]] = []
        for cand in self.cands:
            first, first_instance = len(self.milp.cost), len(self._instance_cols)
            d = cand.deployment
            churn = problem.churn_penalty if d.name in current.deployments else 0.0
            cols: list[int] = []
            by_region: dict[str, list[tuple[Option, int]]] = defaultdict(list)
            for o in cand.options:
                held = current.instances.get((d.name, *o.key), 0)
                # A new placement pays the churn penalty on every instance it adds; an existing one
                # pays it through add/rem below.
                unit = (o.price * (1.0 + (churn if held == 0 else 0.0))) * weight
                self._instance_cols.append((len(self.milp.cost), o, unit, bool(held)))
                if not held:
                    # GPUs a deployment already holds are not priced: the current plan fitted the quotas,
                    # and pricing them would push unchanged deployments around on every re-plan. (Still
                    # a valid Lagrangian bound: leaving out non-negative terms only lowers it.)
                    unit += key_price.get((o.region, o.sku), 0.0) * o.gpus
                upper = o.max_useful
                quota = capacity.get((o.region, o.sku))
                if quota is not None and not elastic:
                    upper = min(upper, max(0, quota) // o.gpus)
                col = self.milp.var(unit, 0.0, float(upper), integer=True)
                cols.append(col)
                by_region[o.region].append((o, col))
                gpu_terms[(o.region, o.sku)].append((col, float(o.gpus)))
                if held and churn:
                    add = self.milp.var(churn * o.price * weight)
                    rem = self.milp.var(churn * o.price * weight)
                    self.milp.row([(add, 1.0), (col, -1.0)], lower=-held)
                    self.milp.row([(rem, 1.0), (col, 1.0)], lower=held)
            self.n.append(cols)
            self._demand(cand, by_region)
            self._spread(problem, cand, by_region)
            if d.disaggregated:
                self._both_pools(by_region)
            self.block_cols.append((first, len(self.milp.cost)))
            self.block_instances.append((first_instance, len(self._instance_cols)))

        for key, terms in sorted(gpu_terms.items()):
            quota = capacity.get(key)
            if quota is None:
                continue
            if elastic:
                slack = self.milp.var(1.0)
                self.capacity_slack[key] = slack
                terms = [*terms, (slack, -1.0)]
            self.capacity_rows[key] = self.milp.row(terms, upper=float(max(0, quota)))

    def retarget(self, capacity: Mapping[Key, int], key_price: Mapping[Key, float]) -> None:
        """The same model for other quotas and quota prices: instance bounds, capacity rows and prices
        as the constructor would set them (a block re-solved against what the others left is not
        built again). `capacity` must quota the same keys as the one the model was built with."""
        for col, o, unit, held in self._instance_cols:
            key = (o.region, o.sku)
            self.milp.cost[col] = unit if held else unit + key_price.get(key, 0.0) * o.gpus
            quota = capacity.get(key)
            upper = o.max_useful if quota is None else min(o.max_useful, max(0, quota) // o.gpus)
            self.milp.col_upper[col] = float(upper)
        for key, row in self.capacity_rows.items():
            self.milp.row_upper[row] = float(max(0, capacity[key]))

    def block_value(self, sol: MilpSolution, k: int, key_price: Mapping[Key, float]) -> float:
        """Deployment k's share of the objective at `sol`, with `key_price` added to the GPUs it
        does not hold today (its block's objective under those quota prices)."""
        first, end = self.block_cols[k]
        value = float(np.dot(np.asarray(self.milp.cost[first:end]), sol.values[first:end]))
        lo, hi = self.block_instances[k]
        for col, o, _, held in self._instance_cols[lo:hi]:
            if not held:
                value += key_price.get((o.region, o.sku), 0.0) * o.gpus * float(sol.values[col])
        return value

    def _demand(self, cand: Candidates, by_region: Mapping[str, list[tuple[Option, int]]]) -> None:
        d = cand.deployment
        flows: dict[tuple[str, str], int] = {}
        for c, regions in cand.reach.items():
            need = d.demand_tokens_per_s.get(c, 0.0)
            if need > 0:
                for r in regions:
                    flows[(c, r)] = self.milp.var(0.0, 0.0, need)
                self.milp.row([(flows[(c, r)], 1.0) for r in regions], lower=need)
            count = d.min_replicas_near.get(c, 0)
            if count > 0:
                terms = [(col, float(min(o.replicas, count))) for r in regions for o, col in by_region[r]]
                self.milp.row(terms, lower=float(count))
        # Implied knapsack rows, per client region and for all of them together: the instances within
        # reach must supply the demand. Redundant with the flows, but written out they let HiGHS derive
        # cover and MIR cuts, which close most of the rounding gap at the root.
        groups = [(need, set(cand.reach[c])) for c in cand.reach if (need := d.demand_tokens_per_s.get(c, 0.0)) > 0]
        if len(groups) > 1:
            groups.append((sum(n for n, _ in groups), set().union(*(rs for _, rs in groups))))
        for need, regions in groups:
            self.milp.row([(col, min(o.tokens_per_s, need)) for r in sorted(regions) for o, col in by_region[r]],
                          lower=need)
        for r, opts in by_region.items():
            served = [(c, col) for (c, rr), col in flows.items() if rr == r]
            if not served:
                continue
            # Coefficient strengthening: a region never carries more than the demand that can reach
            # it, so an instance counts for at most that much. Every integer plan stays feasible, and
            # the LP relaxation can no longer buy a sliver of a big instance.
            reach = sum(d.demand_tokens_per_s[c] for c, _ in served)
            self.milp.row([(col, 1.0) for _, col in served]
                          + [(col, -min(o.tokens_per_s, reach)) for o, col in opts], upper=0.0)
            if len(served) > 1:
                # The same per client: f[c,r] ≤ Σ_o min(tokens_o, demand_c) · n[d,o].
                for c, fcol in served:
                    cap = d.demand_tokens_per_s[c]
                    self.milp.row([(fcol, 1.0)] + [(col, -min(o.tokens_per_s, cap)) for o, col in opts], upper=0.0)

    def _both_pools(self, by_region: Mapping[str, list[tuple[Option, int]]]) -> None:
        """A disaggregated deployment's region holds no instance or at least two (a prefill and
        a decode node): u_r binary, 2·u_r ≤ Σ n ≤ M·u_r."""
        for opts in by_region.values():
            big = sum(self.milp.col_upper[col] for _, col in opts)
            u = self.milp.var(0.0, 0.0, 1.0, integer=True)
            self.milp.row([(col, 1.0) for _, col in opts] + [(u, -2.0)], lower=0.0)
            self.milp.row([(col, 1.0) for _, col in opts] + [(u, -big)], upper=0.0)

    def _spread(self, problem: Problem, cand: Candidates, by_region: Mapping[str, list[tuple[Option, int]]]) -> None:
        if cand.min_regions <= 1 and cand.min_providers <= 1 and cand.deployment.client_regions:
            return  # demand alone forces a replica; no indicator needed
        ys: dict[str, int] = {}
        for r, opts in by_region.items():
            ys[r] = self.milp.var(0.0, 0.0, 1.0, integer=True)
            self.milp.row([(ys[r], 1.0)] + [(col, -1.0) for _, col in opts], upper=0.0)
        self.milp.row([(y, 1.0) for y in ys.values()], lower=float(cand.min_regions))
        if cand.min_providers > 1:
            zs: list[int] = []
            for p in cand.providers:
                z = self.milp.var(0.0, 0.0, 1.0, integer=True)
                zs.append(z)
                mine = [(y, -1.0) for r, y in ys.items() if problem.regions[r].provider == p]
                self.milp.row([(z, 1.0), *mine], upper=0.0)
            self.milp.row([(z, 1.0) for z in zs], lower=float(cand.min_providers))

    def start_from(self, plan: Sequence[Assignment]) -> tuple[np.ndarray, np.ndarray]:
        """A partial starting point (instance counts only) from a plan, for Milp.solve(start=...)."""
        by_key: dict[AssignmentKey, int] = defaultdict(int)
        for a in plan:
            by_key[a.key] += a.instances
        index, value = [], []
        for cand, cols in zip(self.cands, self.n, strict=True):
            for o, col in zip(cand.options, cols, strict=True):
                index.append(col)
                value.append(float(by_key.get((cand.deployment.name, *o.key), 0)))
        return np.asarray(index, dtype=np.int32), np.asarray(value, dtype=np.float64)

    def read(self, sol: MilpSolution, round_up: bool = False, only: int | None = None) -> list[list[Assignment]]:
        """Assignments per deployment of the model, in its order.

        `round_up` reads the LP relaxation's solution as a plan: every fractional instance count
        rounded up (and a disaggregated region's single instance doubled). Rounding up keeps the
        demand, replica and spread rows and the per-option bounds (which are integers); only a
        quota row shared by several options can be exceeded, which the caller checks.
        `only`: deployment k's plan alone (a list of one)."""
        plans: list[list[Assignment]] = []
        blocks = zip(self.cands, self.n, strict=True) if only is None else [(self.cands[only], self.n[only])]
        for cand, cols in blocks:
            counts = [math.ceil(sol.values[col] - _ROUND_TOL) if round_up else int(round(sol.values[col]))
                      for col in cols]
            if round_up and cand.deployment.disaggregated:
                _two_per_region(cand.options, counts)
            mine: list[Assignment] = []
            for o, count in zip(cand.options, counts, strict=True):
                if count > 0:
                    off = o.offering
                    mine.append(Assignment(cand.deployment.name, off.region, off.instance_type, off.sku,
                                           count, count * o.replicas, o.spot, count * o.price))
            plans.append(mine)
        return plans


def _two_per_region(options: Sequence[Option], counts: list[int]) -> None:
    """A disaggregated region with one instance gets a second of the same option (its bound allows
    two: candidates make every option of a disaggregated deployment useful up to two at least)."""
    total: dict[str, int] = defaultdict(int)
    for o, c in zip(options, counts, strict=True):
        total[o.region] += c
    for j, o in enumerate(options):
        if counts[j] and total[o.region] == 1:
            counts[j] += 1
            total[o.region] = 2
