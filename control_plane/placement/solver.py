"""Placement: the cheapest set of instances that meets residency, demand within the RTT objective,
spread, quotas and spot rules, with a churn penalty against the current plan (MILP, HiGHS).

The model is in `model`. How it is solved depends on its size:

- small problems (≤ `SolveOptions.joint_max_options` instance options in all) go to HiGHS whole,
  to the MIP gap;
- larger ones are first split, exactly, into groups of deployments that share no quota that can
  bind (`coupled_groups`: a quota binds only if its options' column bounds together exceed it);
  each group is solved on its own, whole when small enough, and the bounds add up;
- a large group is decomposed, because deployments interact only through quotas and a
  branch-and-bound over hundreds of independent blocks closes its gap far too slowly. (1) The LP
  relaxation of the group gives a lower bound and prices each quota (its dual, per GPU). (2) Each
  deployment's own MILP is solved with those prices added to the GPUs it uses (Lagrangian
  relaxation of the shared quota rows; its own quota rows and bounds stay), starting from its
  current placement, on `SolveOptions.threads` workers. A deployment whose part of the LP solution,
  rounded up, is within the MIP gap of that part's value skips its MILP (the part is an optimal
  solution of its own priced LP, so its value bounds the block). A block that finds no plan in its
  share of the time limit, and every block once the limit has passed, takes its LP rounded up
  instead (noted in the result; rounding up keeps every rule but the shared quotas, which (3)
  enforces). Σ block lower bounds − Σ price × quota is a valid lower bound too; the reported gap
  is measured against the better of the two. (3) Where the blocks overrun a quota together, the
  deployments on it are fitted one at a time, unchanged ones first (what they hold today stays
  reserved for them), then the most constrained: a plan that still fits is kept, else re-solved
  against what is left (its model retargeted, not built again; past the time limit, its LP
  against what is left rounded up when that fits). Should one not fit at all, the whole MILP runs
  for the rest of the time limit from that start.

Plans are then trimmed of single instances that no rule needs (a time-limited block can leave one,
and the next re-plan would count its removal as churn).

Every plan is checked for residency and enabled providers before it is returned
(PlacementInvariantError otherwise).
When the problem is infeasible, the explanation comes from cheap pre-checks (candidates) or,
when only quotas together can be at fault, from an elastic model with a slack per quota row.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from control_plane.placement.candidates import Candidates, build_candidates
from control_plane.placement.check import deployment_violations, provider_violations, residency_violations
from control_plane.placement.diff import churn_counts
from control_plane.placement.milp import INF, MilpSolution, MilpStatus
from control_plane.placement.model import CurrentPlan, Key, PlacementModel
from control_plane.placement.parallel import parallel_map
from control_plane.placement.problem import (
    Assignment,
    PlacementResult,
    Problem,
    SolveOptions,
    SolveStatus,
)
from providers.offerings import Offering

_EPS = 1e-9


class PlacementInvariantError(AssertionError):
    """The solver produced a plan that breaks a hard rule (a bug, never an input problem)."""


class _Infeasible(Exception):
    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


@dataclass(slots=True)
class _Outcome:
    plans: list[list[Assignment]]  # per candidate, in problem order
    lower_bound: float
    proven: bool = False  # HiGHS closed the gap itself (joint path)
    notes: list[str] = field(default_factory=list)


def _objective(problem: Problem, current: CurrentPlan, cands: Sequence[Candidates],
               plans: Sequence[Sequence[Assignment]]) -> float:
    """The model's objective for a plan: cost plus churn penalty over the options it could use."""
    total = 0.0
    for cand, plan in zip(cands, plans, strict=True):
        d = cand.deployment
        counts = {a.key[1:]: a.instances for a in plan}
        churn = problem.churn_penalty if d.name in current.deployments else 0.0
        for o in cand.options:
            n = counts.get(o.key, 0)
            total += o.price * (n + churn * abs(n - current.instances.get((d.name, *o.key), 0)))
    return total


def _trim(problem: Problem, current: CurrentPlan, cand: Candidates, plan: list[Assignment],
          offerings: Mapping[tuple[str, str], Offering]) -> list[Assignment]:
    """Drop single instances the plan does not need, dearest first, while every rule still holds.

    A plan from a time-limited or gap-limited solve can carry a surplus instance; left in, the
    next re-plan would remove it and count that as churn. Dropping an instance never raises the
    objective while churn_penalty ≤ 1 (a held one) or at all (a new one)."""
    d = cand.deployment
    churn = problem.churn_penalty if d.name in current.deployments else 0.0
    plan = list(plan)
    improved = True
    while improved:
        improved = False
        for j in sorted(range(len(plan)), key=lambda j: -plan[j].cost_per_hour / plan[j].instances):
            a = plan[j]
            held = current.instances.get(a.key, 0)
            if a.cost_per_hour <= 0 or (a.instances <= held and churn > 1.0):
                continue
            fewer = replace(a, instances=a.instances - 1, replicas=a.replicas - a.replicas // a.instances,
                            cost_per_hour=a.cost_per_hour - a.cost_per_hour / a.instances)
            trial = plan[:j] + ([fewer] if fewer.instances else []) + plan[j + 1:]
            if not deployment_violations(problem, d, trial, offerings, cand.min_providers):
                plan, improved = trial, True
                break
    return plan


def _usage(cands: Sequence[Candidates], plans: Sequence[Sequence[Assignment]], gpus_of: Mapping[tuple[str, str], int],
           ) -> dict[Key, int]:
    used: dict[Key, int] = defaultdict(int)
    for plan in plans:
        for a in plan:
            used[(a.region, a.sku)] += a.instances * gpus_of[(a.region, a.instance_type)]
    return used


def _explain_capacity(problem: Problem, current: CurrentPlan, cands: Sequence[Candidates],
                      seconds: float) -> list[str]:
    """Solve the elastic model; one line per quota it had to exceed, with the deployments using it."""
    model = PlacementModel(problem, current, cands, problem.capacity, elastic=True)
    sol = model.milp.solve(max(seconds, 1.0), 1e-4)
    if not sol.has_solution:
        return ["capacity: the quotas cannot be met (the elastic relaxation found no plan in the time limit)"]
    plans = model.read(sol)
    users: dict[Key, set[str]] = defaultdict(set)
    for plan in plans:
        for a in plan:
            users[(a.region, a.sku)].add(a.deployment)
    lines = []
    for (region, sku), col in sorted(model.capacity_slack.items()):
        excess = sol.values[col]
        if excess > 1e-6:
            quota = problem.capacity[(region, sku)]
            names = sorted(users[(region, sku)])
            more = f" and {len(names) - 6} more" if len(names) > 6 else ""
            lines.append(f"capacity: {sku} in {region}: need {quota + round(excess)} GPUs, quota {quota}"
                         f" (deployments {', '.join(names[:6])}{more})")
    return lines or ["capacity: the quotas together cannot be met (no single quota to blame)"]


def _solve_joint(problem: Problem, current: CurrentPlan, cands: Sequence[Candidates], options: SolveOptions,
                 deadline: float, start: Sequence[Assignment] = ()) -> _Outcome:
    model = PlacementModel(problem, current, cands, problem.capacity)
    sol = model.milp.solve(max(0.05, deadline - time.perf_counter()), options.mip_rel_gap,
                           start=model.start_from(start) if start else None)
    if not sol.has_solution:
        if sol.status is MilpStatus.INFEASIBLE:
            raise _Infeasible(_explain_capacity(problem, current, cands, deadline - time.perf_counter()))
        raise TimeoutError(f"no plan found within the time limit (HiGHS status {sol.status})")
    return _Outcome(model.read(sol), sol.dual_bound, proven=sol.status is MilpStatus.OPTIMAL)


class _Decomposition:
    """Lagrangian decomposition over deployments, then quotas enforced greedily (see the module docstring)."""

    def __init__(self, problem: Problem, current: CurrentPlan, cands: list[Candidates], options: SolveOptions,
                 deadline: float) -> None:
        self.problem, self.current, self.cands = problem, current, cands
        self.options, self.deadline = options, deadline
        self.gpus_of = {(o.region, o.instance_type): o.gpu_count for o in problem.offerings}
        self.offerings = {(o.region, o.instance_type): o for o in problem.offerings}
        self.current_plan: dict[str, list[Assignment]] = defaultdict(list)
        for a in problem.current:
            self.current_plan[a.deployment].append(a)
        self._original: list[list[Assignment]] = []  # the blocks' own plans, before quotas are enforced
        # Each deployment's model, built once: a re-fit retargets it at what the others left.
        self._models: dict[int, PlacementModel] = {}
        self._lock = threading.Lock()
        self.rounded = 0  # plans read from a block's LP relaxation, rounded up (its time share ran out)
        self._lp: tuple[PlacementModel, MilpSolution] | None = None  # the whole LP relaxation, solved

    def _left(self) -> float:
        return max(0.05, self.deadline - time.perf_counter())

    def run(self) -> _Outcome:
        lp_bound, prices = self._quota_prices()
        plans, bounds = self._blocks(prices)
        self._original = [list(p) for p in plans]
        lagrangian = sum(bounds) - sum(p * self.problem.capacity[k] for k, p in prices.items())
        notes = self._enforce_quotas(plans, prices)
        if notes and notes[-1].startswith("joint"):
            return self._joint_fallback(plans, max(lp_bound, lagrangian), notes)
        if self.rounded:
            notes.append(f"{self.rounded} plans are LP relaxations rounded up: their MILPs found no plan in"
                         " their share of the time limit")
        return _Outcome(plans, max(lp_bound, lagrangian), notes=notes)

    def _quota_prices(self) -> tuple[float, dict[Key, float]]:
        """The whole model's LP relaxation: its bound, and the duals of the capacity rows as per-GPU prices.
        The model and its solution are kept: each block's part of it is an optimal solution of the
        block's own LP under those prices (complementary slackness), which `_from_lp` uses."""
        model = PlacementModel(self.problem, self.current, self.cands, self.problem.capacity)
        model.milp.integer = [0] * len(model.milp.integer)
        sol = model.milp.solve(self._left(), self.options.mip_rel_gap)
        if sol.status is MilpStatus.INFEASIBLE:
            raise _Infeasible(_explain_capacity(self.problem, self.current, self.cands, self._left()))
        if not sol.has_solution:
            return -INF, {}
        if sol.status is MilpStatus.OPTIMAL:
            self._lp = (model, sol)
        # HiGHS reports ≤ rows of a minimisation with duals ≤ 0; the price of a GPU is its negation.
        prices = {k: -float(sol.row_duals[row]) for k, row in model.capacity_rows.items()
                  if -sol.row_duals[row] > _EPS}
        return sol.objective, prices

    def _from_lp(self, i: int, prices: Mapping[Key, float]) -> tuple[list[Assignment], float, float] | None:
        """Deployment i's part of the whole LP relaxation rounded up: (plan, the part's LP value, which
        bounds the block's priced objective, and the plan's priced objective); None without the LP."""
        if self._lp is None:
            return None
        model, sol = self._lp
        plan = model.read(sol, round_up=True, only=i)[0]
        value = _objective(self.problem, self.current, [self.cands[i]], [plan]) + sum(
            prices.get((a.region, a.sku), 0.0) * a.instances * self.gpus_of[(a.region, a.instance_type)]
            for a in plan if not self.current.instances.get(a.key))
        return plan, model.block_value(sol, i, prices), value

    def _checked(self, i: int, plan: list[Assignment]) -> list[Assignment]:
        cand = self.cands[i]
        if deployment_violations(self.problem, cand.deployment, plan, self.offerings, cand.min_providers):
            raise PlacementInvariantError(f"deployment {cand.deployment.name}: its rounded LP plan breaks a rule")
        return plan

    def _solve_block(self, i: int, capacity: Mapping[Key, int], prices: Mapping[Key, float],
                     seconds: float) -> tuple[list[Assignment], float] | None:
        """One deployment's MILP; (plan, lower bound on its priced objective), or None when infeasible.

        It starts from the deployment's current placement, so an unchanged deployment keeps it
        unless something cheaper by more than the churn penalty turns up."""
        cand = self.cands[i]
        model = self._models.get(i)
        if model is None:
            model = self._models[i] = PlacementModel(self.problem, self.current, [cand], capacity, key_price=prices)
        else:
            model.retarget(capacity, prices)
        start = self.current_plan.get(cand.deployment.name)
        begin = model.start_from(start) if start else None
        if time.perf_counter() >= self.deadline:
            # Past the time limit (re-fits after a long first pass): the LP rounded up, if it fits.
            rounded = self._rounded(model, capacity)
            if rounded is not None:
                with self._lock:
                    self.rounded += 1
                return rounded
        sol = model.milp.solve(seconds, self.options.mip_rel_gap, start=begin)
        if not sol.has_solution and sol.status is MilpStatus.TIME_LIMIT:
            # Its share of the time was too short to find any plan (a loaded machine, a fleet of
            # thousands): its LP relaxation rounded up is one, with the LP's value as its bound.
            rounded = self._rounded(model, capacity)
            if rounded is not None:
                with self._lock:
                    self.rounded += 1
                return rounded
            retry = max(4.0 * seconds, min(1.0, max(0.25, self._left())))
            sol = model.milp.solve(retry, self.options.mip_rel_gap, start=begin)
        if not sol.has_solution:
            if sol.status is MilpStatus.INFEASIBLE:
                return None
            raise TimeoutError(f"deployment {cand.deployment.name}: no plan found within the time limit"
                               f" (HiGHS status {sol.status})")
        return model.read(sol)[0], sol.dual_bound

    def _rounded(self, model: PlacementModel, capacity: Mapping[Key, int]) -> tuple[list[Assignment], float] | None:
        """The block's LP relaxation rounded up, with the LP optimum as its bound; None when the LP
        finds nothing in a second or the rounded plan overruns a quota (then the MILP gets longer)."""
        integer = model.milp.integer
        model.milp.integer = [0] * len(integer)
        try:
            lp = model.milp.solve(1.0, self.options.mip_rel_gap)
        finally:
            model.milp.integer = integer
        if not lp.has_solution or lp.status is not MilpStatus.OPTIMAL:
            return None
        plan = model.read(lp, round_up=True)[0]
        used = _usage([model.cands[0]], [plan], self.gpus_of)
        if any(g > capacity.get(k, g) for k, g in used.items()):
            return None
        cand = model.cands[0]
        if deployment_violations(self.problem, cand.deployment, plan, self.offerings, cand.min_providers):
            raise PlacementInvariantError(f"deployment {cand.deployment.name}: its rounded LP plan breaks a rule")
        return plan, lp.objective

    def _blocks(self, prices: Mapping[Key, float]) -> tuple[list[list[Assignment]], list[float]]:
        """Each deployment's plan under the quota prices and a lower bound on its priced objective.

        A deployment whose part of the LP rounds up to within the MIP gap of that part's value needs
        no MILP. The others are solved most rounding loss first, so that when the time runs short the
        ones left to rounding are those it costs least. Blocks share most of what is left of the time
        limit, quotas get the rest; a block may take twice its share (per worker): most finish in a
        few milliseconds, a few need more. Past the time limit no block gets a MILP (a rounded plan
        now beats a better one long after it); past the phase's end a block still gets a short one."""
        rounding = [self._from_lp(i, prices) for i in range(len(self.cands))]
        results: list[tuple[list[Assignment], float] | None] = [None] * len(self.cands)
        queue: list[int] = []
        for i, r in enumerate(rounding):
            if r is not None and r[2] <= r[1] * (1.0 + self.options.mip_rel_gap) + _EPS:
                results[i] = (self._checked(i, r[0]), r[1])
            else:
                queue.append(i)
        queue.sort(key=lambda i: -(r[2] - r[1]) if (r := rounding[i]) is not None else -INF)
        phase_end = time.perf_counter() + 0.7 * self._left()
        workers = max(1, min(self.options.threads, len(queue)))
        lock = threading.Lock()
        started = [0]

        def one(i: int) -> tuple[list[Assignment], float]:
            with lock:
                waiting = len(queue) - started[0]
                started[0] += 1
            r = rounding[i]
            if r is not None and time.perf_counter() >= self.deadline:
                with self._lock:
                    self.rounded += 1
                return self._checked(i, r[0]), r[1]
            share = 2.0 * workers * (phase_end - time.perf_counter()) / waiting
            got = self._solve_block(i, self.problem.capacity, prices, max(0.01, share))
            if got is None:
                # Alone within its quotas, the deployment cannot be placed: name the quota.
                raise _Infeasible(_explain_capacity(self.problem, self.current, [self.cands[i]], self._left()))
            return got

        for i, got in zip(queue, parallel_map(one, queue, workers), strict=True):
            results[i] = got
        plans, bounds = [], []
        for got in results:
            assert got is not None  # every deployment was either rounded or queued
            plans.append(got[0])
            bounds.append(got[1])
        return plans, bounds

    def _enforce_quotas(self, plans: list[list[Assignment]], prices: Mapping[Key, float]) -> list[str]:
        """Make the blocks' plans respect the quotas together; notes what it did.

        Plans that use no overrun quota are kept. The others are taken most constrained first (fewest
        options): kept when they still fit in what is left, else re-solved against what is left.
        When one cannot be placed that way, the last note starts with "joint" (the caller falls back
        to the whole MILP)."""
        capacity = self.problem.capacity
        used = _usage(self.cands, plans, self.gpus_of)
        over = {k for k, q in capacity.items() if used.get(k, 0) > q}
        if not over:
            return []
        contested = [i for i, plan in enumerate(plans) if any((a.region, a.sku) in over for a in plan)]
        # Deployments whose plan is their current placement go first: the current placement fitted
        # the quotas, so they keep it and only what had to change is re-fitted. Then the most
        # constrained (fewest options).
        unchanged = {i for i in contested if self._is_current(i, self._original[i])}
        contested.sort(key=lambda i: (i not in unchanged, len(self.cands[i].options), self.cands[i].deployment.name))
        for i in contested:
            plans[i] = []
        notes = [f"quotas overrun by the independent plans: {', '.join(f'{k[1]} in {k[0]}' for k in sorted(over))};"
                 f" {len(contested)} deployments re-fitted"]
        used = _usage(self.cands, plans, self.gpus_of)
        # What the deployments still to be fitted hold today stays theirs until their turn, so that a
        # re-plan does not hand one deployment's current GPUs to another.
        reserved: dict[Key, int] = defaultdict(int)
        for i in contested:
            for k, g in self._held_gpus(i).items():
                reserved[k] += g
        resolved = 0
        for n, i in enumerate(contested):
            for k, g in self._held_gpus(i).items():
                reserved[k] -= g
            original = self._original[i]
            need: dict[Key, int] = defaultdict(int)
            for a in original:
                need[(a.region, a.sku)] += a.instances * self.gpus_of[(a.region, a.instance_type)]
            if all(used.get(k, 0) + reserved.get(k, 0) + g <= capacity.get(k, 1 << 62) for k, g in need.items()):
                plans[i] = original
            else:
                residual = {k: max(0, q - used.get(k, 0) - reserved.get(k, 0)) for k, q in capacity.items()}
                got = self._solve_block(i, residual, prices, max(0.02, 0.5 * self._left() / (len(contested) - n)))
                if got is None:
                    notes.append(f"joint: {self.cands[i].deployment.name} did not fit in what the others left")
                    return notes
                plans[i] = got[0]
                resolved += 1
            for a in plans[i]:
                used[(a.region, a.sku)] += a.instances * self.gpus_of[(a.region, a.instance_type)]
        notes.append(f"{resolved} re-solved against the quotas left")
        return notes

    def _held_gpus(self, i: int) -> dict[Key, int]:
        """GPUs per key the deployment holds in the current plan, on offerings that still exist."""
        held: dict[Key, int] = defaultdict(int)
        for a in self.current_plan.get(self.cands[i].deployment.name, ()):
            gpus = self.gpus_of.get((a.region, a.instance_type))
            if gpus is not None:
                held[(a.region, a.sku)] += a.instances * gpus
        return held

    def _is_current(self, i: int, plan: Sequence[Assignment]) -> bool:
        held = self.current_plan.get(self.cands[i].deployment.name, [])
        return bool(held) and sorted(a.key + (a.instances,) for a in held) == sorted(a.key + (a.instances,) for a in plan)

    def _joint_fallback(self, plans: list[list[Assignment]], lower: float, notes: list[str]) -> _Outcome:
        """The whole MILP for the rest of the time limit, from the partial greedy plan."""
        start = [a for plan in plans for a in plan]
        outcome = _solve_joint(self.problem, self.current, self.cands, self.options, self.deadline, start=start)
        outcome.lower_bound = max(outcome.lower_bound, lower)
        outcome.notes = [*notes, "solved whole"]
        return outcome


def coupled_groups(problem: Problem, cands: Sequence[Candidates]) -> list[list[int]]:
    """The deployments (indices into `cands`) in groups that share no quota that can bind.

    A quota row can bind only when the GPUs its options could take together (each option's
    column bound: instances beyond it never help) exceed the quota; deployments are coupled
    through such rows alone, so groups joined by none are independent problems. Largest first."""
    parent = list(range(len(cands)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    most: dict[Key, int] = defaultdict(int)
    users: dict[Key, set[int]] = defaultdict(set)
    for i, cand in enumerate(cands):
        for o in cand.options:
            most[(o.region, o.sku)] += o.max_useful * o.gpus
            users[(o.region, o.sku)].add(i)
    for key, gpus in most.items():
        quota = problem.capacity.get(key)
        if quota is not None and gpus > quota:
            first, *rest = sorted(users[key])
            for j in rest:
                parent[root(j)] = root(first)
    groups: dict[int, list[int]] = defaultdict(list)
    for i in range(len(cands)):
        groups[root(i)].append(i)
    return sorted(groups.values(), key=lambda g: (-len(g), g[0]))


def _solve_components(problem: Problem, current: CurrentPlan, cands: Sequence[Candidates], options: SolveOptions,
                      deadline: float) -> _Outcome:
    """Each independent group on its own (exact: nothing couples them), in a share of the time
    limit by its size: whole when small enough, else decomposed. Bounds add up."""
    groups = coupled_groups(problem, cands)
    sizes = [sum(len(cands[i].options) for i in g) for g in groups]
    plans: list[list[Assignment]] = [[] for _ in cands]
    lower, proven, notes = 0.0, True, []
    for n, group in enumerate(groups):
        now = time.perf_counter()
        part_deadline = now + (deadline - now) * sizes[n] / sum(sizes[n:])
        part = [cands[i] for i in group]
        if sizes[n] <= options.joint_max_options:
            outcome = _solve_joint(problem, current, part, options, part_deadline)
        else:
            outcome = _Decomposition(problem, current, part, options, part_deadline).run()
        for i, plan in zip(group, outcome.plans, strict=True):
            plans[i] = plan
        lower += outcome.lower_bound
        proven = proven and outcome.proven
        notes.extend(outcome.notes)
    if len(groups) > 1:
        notes.insert(0, f"{len(groups)} independent groups of deployments (largest {len(groups[0])})")
    return _Outcome(plans, lower, proven=proven, notes=notes)


def solve(problem: Problem, options: SolveOptions | None = None) -> PlacementResult:
    """The cheapest placement meeting every constraint, or an explanation of which one cannot be met."""
    options = options or SolveOptions()
    t0 = time.perf_counter()
    deadline = t0 + options.time_limit_s
    cands, errors = build_candidates(problem)
    if errors:
        return PlacementResult(SolveStatus.INFEASIBLE, explanation=tuple(errors), solve_seconds=time.perf_counter() - t0)
    current = CurrentPlan.of(problem)
    if not problem.deployments:
        removed = sum(a.replicas for a in problem.current)
        return PlacementResult(SolveStatus.OPTIMAL, replicas_removed=removed, solve_seconds=time.perf_counter() - t0)
    try:
        if sum(len(c.options) for c in cands) <= options.joint_max_options:
            outcome = _solve_joint(problem, current, cands, options, deadline)
        else:
            outcome = _solve_components(problem, current, cands, options, deadline)
    except _Infeasible as e:
        return PlacementResult(SolveStatus.INFEASIBLE, explanation=tuple(e.lines), solve_seconds=time.perf_counter() - t0)
    except TimeoutError as e:
        return PlacementResult(SolveStatus.TIMEOUT, explanation=(str(e),), solve_seconds=time.perf_counter() - t0)

    offerings = {(o.region, o.instance_type): o for o in problem.offerings}
    plans = [_trim(problem, current, cand, plan, offerings) for cand, plan in zip(cands, outcome.plans, strict=True)]
    assignments = [a for plan in plans for a in plan]
    broken = residency_violations(problem, assignments) + provider_violations(problem, assignments)
    if broken:
        raise PlacementInvariantError("; ".join(broken))
    objective = _objective(problem, current, cands, plans)
    gap = max(0.0, (objective - outcome.lower_bound) / objective) if objective > _EPS else 0.0
    added, removed = churn_counts(tuple(problem.current), assignments)
    costs = {d.name: 0.0 for d in problem.deployments}
    for a in assignments:
        costs[a.deployment] += a.cost_per_hour
    return PlacementResult(
        status=SolveStatus.OPTIMAL if outcome.proven or gap <= options.mip_rel_gap + 1e-9 else SolveStatus.FEASIBLE,
        assignments=tuple(assignments),
        total_cost_per_hour=sum(costs.values()),
        cost_per_deployment=costs,
        replicas_added=added,
        replicas_removed=removed,
        notes=tuple(outcome.notes),
        objective=objective,
        mip_gap=gap,
        lower_bound=outcome.lower_bound,
        solve_seconds=time.perf_counter() - t0,
    )
