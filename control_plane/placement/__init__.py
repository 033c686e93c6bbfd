"""Model fit and the placement solver: which SKUs a model fits on, and where its replicas should live.

Pure functions over dataclasses (no database, no HTTP); the admin API calls `fit_model`,
`solve` and `diff`.
"""

from control_plane.placement.diff import PlanChange, PlanDiff, diff
from control_plane.placement.fit import FitAssumptions, ModelFit, ModelSpec, SkuFit, fit_model, fit_sku
from control_plane.placement.problem import (
    Assignment,
    Deployment,
    PlacementResult,
    Problem,
    ReplicaShape,
    SolveOptions,
    shapes_from_fit,
)
from control_plane.placement.solver import PlacementInvariantError, solve

__all__ = [
    "Assignment",
    "Deployment",
    "FitAssumptions",
    "ModelFit",
    "ModelSpec",
    "PlacementInvariantError",
    "PlacementResult",
    "PlanChange",
    "PlanDiff",
    "Problem",
    "ReplicaShape",
    "SkuFit",
    "SolveOptions",
    "diff",
    "fit_model",
    "fit_sku",
    "shapes_from_fit",
    "solve",
]
