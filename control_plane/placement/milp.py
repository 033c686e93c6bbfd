"""A thin MILP builder over HiGHS: columns and sparse rows collected in lists, passed in one call.

highspy's expression API builds one Python object per term, which is too slow for the ~10^5
non-zeros of a fleet-sized placement; this collects plain arrays instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import highspy
import numpy as np

INF = highspy.kHighsInf


class MilpStatus(StrEnum):
    """HiGHS's model status, as the solver reads it."""

    OPTIMAL = "optimal"
    INFEASIBLE = "infeasible"  # costs are non-negative: "unbounded or infeasible" is this too
    TIME_LIMIT = "time_limit"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class MilpSolution:
    """What came back: HiGHS's model status, the column values (when it has any), and figures."""

    status: MilpStatus
    has_solution: bool
    values: np.ndarray
    objective: float
    dual_bound: float  # a lower bound on the optimum (-inf when none is known)
    seconds: float
    row_duals: np.ndarray  # LP only (no integer columns): the rows' dual values; else empty


@dataclass(slots=True)
class Milp:
    """Minimise cost·x subject to lower ≤ A x ≤ upper and column bounds; some columns integer."""

    cost: list[float] = field(default_factory=list)
    col_lower: list[float] = field(default_factory=list)
    col_upper: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)

    def var(self, cost: float, lower: float = 0.0, upper: float = INF, integer: bool = False) -> int:
        """Add a column; returns its index."""
        self.cost.append(cost)
        self.col_lower.append(lower)
        self.col_upper.append(upper)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lower: float = -INF, upper: float = INF) -> int:
        """Add lower ≤ Σ coef·x[col] ≤ upper; returns the row index."""
        self.starts.append(len(self.index))
        for col, coef in terms:
            self.index.append(col)
            self.value.append(coef)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        return len(self.row_lower) - 1

    def solve(
        self,
        time_limit_s: float,
        mip_rel_gap: float,
        start: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> MilpSolution:
        """Solve with HiGHS under the given limits, optionally from a (partial) starting solution
        given as (column indices, values). HiGHS's own thread setting is left alone: it sizes one
        process-wide scheduler on its first run, and a later, different value makes runs fail."""
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        # Feasibility jump costs ~12 ms per run whatever the model's size, which dominates the many
        # small per-deployment models; the other heuristics find plans of this structure anyway.
        h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
        n, m = len(self.cost), len(self.row_lower)
        h.passModel(
            n, m, len(self.index), int(highspy.MatrixFormat.kRowwise), int(highspy.ObjSense.kMinimize), 0.0,
            np.asarray(self.cost, dtype=np.float64),
            np.asarray(self.col_lower, dtype=np.float64),
            np.asarray(self.col_upper, dtype=np.float64),
            np.asarray(self.row_lower, dtype=np.float64),
            np.asarray(self.row_upper, dtype=np.float64),
            np.asarray([*self.starts, len(self.index)], dtype=np.int32),
            np.asarray(self.index, dtype=np.int32),
            np.asarray(self.value, dtype=np.float64),
            np.asarray(self.integer, dtype=np.int32),
        )
        if start is not None and len(start[0]):
            h.setSolution(len(start[0]), start[0], start[1])
        h.run()
        ms = h.getModelStatus()
        status = {
            highspy.HighsModelStatus.kOptimal: MilpStatus.OPTIMAL,
            highspy.HighsModelStatus.kInfeasible: MilpStatus.INFEASIBLE,
            # Costs are non-negative, so "unbounded or infeasible" can only be infeasible.
            highspy.HighsModelStatus.kUnboundedOrInfeasible: MilpStatus.INFEASIBLE,
            highspy.HighsModelStatus.kTimeLimit: MilpStatus.TIME_LIMIT,
        }.get(ms, MilpStatus.OTHER)
        info = h.getInfo()
        has_solution = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
        solution = h.getSolution()
        values = np.asarray(solution.col_value, dtype=np.float64) if has_solution else np.zeros(n)
        duals = np.asarray(solution.row_dual, dtype=np.float64) if has_solution and not any(self.integer) \
            else np.zeros(0)
        objective = float(info.objective_function_value) if has_solution else INF
        if any(self.integer):
            bound = float(info.mip_dual_bound)
        else:
            bound = objective if status is MilpStatus.OPTIMAL else -INF
        if status is MilpStatus.OPTIMAL and has_solution:
            bound = min(bound, objective)
        return MilpSolution(status, has_solution, values, objective, bound, float(h.getRunTime()), duals)
