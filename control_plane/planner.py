"""Placement plans from the control plane's state: build the solver's problem, keep plans as rows.

Solving is pure and slow (seconds), so callers read the state in one transaction, solve
outside any transaction, and write the plan in another. Only the newest plan can be applied:
storing a plan supersedes every older preview, and applying one supersedes the rest, so a
preview that a newer one (or a plan in force) has overtaken is refused (409) rather than put in
force over what its operator never saw. Applying also checks that the plan was solved against
the placement still in force, and that every provider it uses has a driver in this control
plane (a plan previewed before MERIDIAN_PROVIDER_ENABLED changed could never be carried out).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane import audit, capacity_store, deployment_store, model_store
from control_plane.audit import Actor
from control_plane.db.models import Deployment, ModelRecord, PlacementPlan
from control_plane.errors import Conflict, NotFound
from control_plane.placement.diff import PlanDiff, diff
from control_plane.placement.fit import ModelFit, fit_model, prefill_per_decode
from control_plane.placement.pools import PoolPlan, split_pools
from control_plane.placement.problem import (
    Assignment,
    PlacementResult,
    Problem,
    ReplicaShape,
    SolveOptions,
    SolveStatus,
    shapes_from_fit,
)
from control_plane.placement.problem import Deployment as PlacementDeployment
from control_plane.placement.solver import solve
from meridian.admin_api import PlanStatus
from meridian.contracts import DisaggregationSpec, PlacementSpec, RegionInfo
from providers.catalog import Catalog


@dataclass(frozen=True, slots=True)
class PlanningState:
    """What a plan is solved from, read in one transaction."""

    problem: Problem
    base_plan_id: str | None
    # Deployments that cannot be placed before solving (no model spec, fits no SKU).
    blockers: tuple[str, ...]
    # Disaggregated deployments: how their regions split into prefill and decode pools.
    pools: Mapping[str, PoolPlan] = dataclasses.field(default_factory=dict)


def current_plan(session: Session) -> PlacementPlan | None:
    """The applied plan: the placement in force."""
    return session.scalars(select(PlacementPlan).where(PlacementPlan.status == PlanStatus.APPLIED)).one_or_none()


def assignment_as_dict(a: Assignment) -> dict[str, Any]:
    return dataclasses.asdict(a)


def assignment_of(data: Mapping[str, Any]) -> Assignment:
    return Assignment(**{f.name: data[f.name] for f in dataclasses.fields(Assignment) if f.name in data})


def _pool_plan(spec: DisaggregationSpec, fit: ModelFit) -> PoolPlan:
    """The ratio per SKU (the deployment's, else fit's from its mix) and the explicit pools."""
    ratios = {
        sku: spec.prefill_per_decode if spec.prefill_per_decode is not None
        else prefill_per_decode(f, spec.mean_prompt_tokens, spec.mean_output_tokens)
        for sku, f in fit.per_sku.items()
    }
    return PoolPlan(ratios, {r: (p.prefill, p.decode) for r, p in spec.pools.items()})


def _deployment(
    row: Deployment, model: ModelRecord | None, catalog: Catalog, blockers: list[str], pools: dict[str, PoolPlan]
) -> PlacementDeployment | None:
    if model is None:
        blockers.append(f"deployment {row.model}: no model spec; PUT /v1/models/{row.model} first")
        return None
    # The catalog's SKUs, as GET /v1/models/{name}/fit sizes them.
    fit = fit_model(model_store.spec_of(model), catalog.skus)
    if not fit.per_sku:
        blockers.append(f"deployment {row.model}: the model fits on no GPU SKU (even at tensor parallelism 8)")
        return None
    spec = PlacementSpec.model_validate(row.placement or {})
    shapes = shapes_from_fit(fit)
    topology = deployment_store.disaggregation_of(row)
    if topology is not None:
        # Only decode replicas generate: a replica counts for the decode share of its rate.
        pools[row.model] = plan = _pool_plan(topology, fit)
        shapes = {sku: ReplicaShape(s.tp, s.tokens_per_s * plan.decode_share(sku)) for sku, s in shapes.items()}
    return PlacementDeployment(
        name=row.model,
        shapes=shapes,
        zone=row.zone,
        demand_tokens_per_s=dict(spec.demand),
        min_replicas_near=dict(spec.replicas),
        rtt_objective_ms=spec.rtt_objective_ms,
        min_regions=spec.min_regions,
        # min_providers 2 is the default "where the zone has them"; the solver caps it.
        min_providers=None if spec.min_providers == 2 else spec.min_providers,
        allowed_skus=frozenset(spec.allowed_skus) if spec.allowed_skus is not None else None,
        spot_allowed=spec.spot,
        disaggregated=topology is not None,
    )


def read_state(
    session: Session, catalog: Catalog, regions: Mapping[str, RegionInfo], providers: frozenset[str] | None = None
) -> PlanningState:
    """The placement problem of every deployment, against the placement in force, over the
    regions of `providers` (those whose drivers the control plane runs; None: every provider)."""
    models = {m.name: m for m in session.scalars(select(ModelRecord)).all()}
    blockers: list[str] = []
    deployments = []
    pools: dict[str, PoolPlan] = {}
    for row in session.scalars(select(Deployment).order_by(Deployment.model)).all():
        d = _deployment(row, models.get(row.model), catalog, blockers, pools)
        if d is not None:
            deployments.append(d)
    current = current_plan(session)
    problem = Problem(
        deployments=deployments,
        offerings=catalog.offerings,
        regions=regions,
        # The same limits GET /v1/capacity shows: explicit rows over the on-prem inventory's hosts.
        capacity={(c.region, c.sku): c.max_gpus for c in capacity_store.effective(session, catalog)},
        current=[assignment_of(a) for a in current.assignments] if current else (),
        providers=providers,
    )
    return PlanningState(problem=problem, base_plan_id=current.id if current else None, blockers=tuple(blockers),
                         pools=pools)


def solve_state(state: PlanningState, options: SolveOptions | None = None) -> PlacementResult:
    """Solve (pure, slow: run it outside any transaction)."""
    if state.blockers:
        return PlacementResult(SolveStatus.INFEASIBLE, explanation=state.blockers)
    result = solve(state.problem, options)
    if not result.feasible or not state.pools:
        return result
    # Each node of a disaggregated deployment gets its role (the reconciler launches it so).
    split: list[Assignment] = []
    for d in state.problem.deployments:
        mine = [a for a in result.assignments if a.deployment == d.name]
        split.extend(split_pools(state.pools[d.name], mine) if d.name in state.pools else mine)
    return dataclasses.replace(result, assignments=tuple(split))


def diff_as_dict(d: PlanDiff) -> dict[str, Any]:
    def rows(changes: Any) -> list[dict[str, Any]]:
        return [dataclasses.asdict(c) for c in changes]

    return {
        "added": rows(d.added),
        "removed": rows(d.removed),
        "changed": rows(d.changed),
        "cost_delta_per_hour": round(d.cost_delta_per_hour, 6),
    }


def store_plan(
    session: Session, state: PlanningState, result: PlacementResult, actor: Actor, now: datetime
) -> PlacementPlan:
    """Keep a solved plan as a preview (or an infeasible one with its explanation); older previews
    are superseded by it."""
    new = list(result.assignments)
    _supersede_previews(session)
    plan = PlacementPlan(
        id=str(uuid.uuid4()),
        status=PlanStatus.PREVIEW if result.feasible else PlanStatus.INFEASIBLE,
        base_plan_id=state.base_plan_id,
        cost_per_hour=result.total_cost_per_hour if result.feasible else None,
        assignments=[assignment_as_dict(a) for a in new],
        diff=diff_as_dict(diff(state.problem.current, new)) if result.feasible else {},
        explanation="\n".join(result.explanation) or None,
        solve_seconds=result.solve_seconds,
        created_at=now,
        created_by=actor.name,
    )
    session.add(plan)
    session.flush()
    audit.record(session, actor, action="preview", resource_type="placement_plan", resource_id=plan.id,
                 before=None, after=plan_summary(plan), now=now)
    return plan


def plan_summary(plan: PlacementPlan) -> dict[str, Any]:
    """A plan without its (long) assignment list, for the audit log."""
    return {
        "id": plan.id,
        "status": plan.status,
        "base_plan_id": plan.base_plan_id,
        "cost_per_hour": plan.cost_per_hour,
        "assignments": len(plan.assignments),
        "diff": {k: len(v) if isinstance(v, list) else v for k, v in plan.diff.items()},
    }


def get_plan(session: Session, plan_id: str, *, for_update: bool = False) -> PlacementPlan:
    row = session.get(PlacementPlan, plan_id, with_for_update=for_update)
    if row is None:
        raise NotFound(f"no placement plan {plan_id!r}")
    return row


def _supersede_previews(session: Session) -> None:
    """Every preview waiting to be applied is overtaken (by a newer plan, or one put in force)."""
    session.execute(
        update(PlacementPlan).where(PlacementPlan.status == PlanStatus.PREVIEW)
        .values(status=PlanStatus.SUPERSEDED).execution_options(synchronize_session="fetch")
    )


def providers_without_driver(assignments: Sequence[Mapping[str, Any]], enabled: frozenset[str]) -> list[str]:
    """The providers a plan's assignments use that are not in `enabled`, sorted."""
    return sorted({str(a.get("region", "")).split(":", 1)[0] for a in assignments} - enabled)


def apply_plan(
    session: Session, plan_id: str, actor: Actor, now: datetime, providers: frozenset[str] | None = None
) -> PlacementPlan:
    """Make a previewed plan the placement in force; Conflict when it is stale, not a preview, or
    needs a provider outside `providers` (those with a driver here; None: any)."""
    plan = get_plan(session, plan_id, for_update=True)
    if plan.status == PlanStatus.SUPERSEDED and plan.applied_at is None:
        raise Conflict(f"plan {plan_id} is a stale preview: a newer plan was previewed or applied since;"
                       " apply the newest preview or preview a new plan")
    if plan.status != PlanStatus.PREVIEW:
        raise Conflict(f"plan {plan_id} is {plan.status}; only a preview can be applied")
    missing = providers_without_driver(plan.assignments, providers) if providers is not None else []
    if missing:
        raise Conflict(f"plan {plan_id} places node groups on {', '.join(missing)}, which this control plane has"
                       f" no driver for (MERIDIAN_PROVIDER_ENABLED: {', '.join(sorted(providers or ()))});"
                       " preview a new plan")
    # Lock the applied row too, so two concurrent applies serialise and the second sees it changed.
    current = session.scalars(
        select(PlacementPlan).where(PlacementPlan.status == PlanStatus.APPLIED).with_for_update()
    ).one_or_none()
    current_id = current.id if current else None
    if plan.base_plan_id != current_id:
        raise Conflict(
            f"plan {plan_id} was solved against placement {plan.base_plan_id or 'none'}, but "
            f"{current_id or 'none'} is in force now; preview a new plan"
        )
    if current is not None:
        current.status = PlanStatus.SUPERSEDED
        session.flush()
    plan.status = PlanStatus.APPLIED
    session.flush()
    _supersede_previews(session)
    plan.applied_at = now
    plan.applied_by = actor.name
    session.flush()
    audit.record(session, actor, action="apply", resource_type="placement_plan", resource_id=plan.id,
                 before={"placement_in_force": current_id}, after=plan_summary(plan), now=now)
    return plan
