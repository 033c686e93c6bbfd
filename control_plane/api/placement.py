"""Placement plans: preview (solve against the placement in force, with its diff), list, apply."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from control_plane import planner
from control_plane.api.pagination import PageParams, page_params, paginate, set_next_link
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_scopes
from control_plane.db.models import PlacementPlan
from control_plane.errors import Conflict, NotFound
from control_plane.placement.problem import SolveOptions
from control_plane.scopes import FLEET_READERS, Scope

router = APIRouter(prefix="/v1/placement")
readers = [Depends(require_scopes(FLEET_READERS))]
OperatorActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN, Scope.OPERATOR]))]
PlanIdParam = Annotated[str, Path(min_length=1, max_length=36)]


class PlanRequest(BaseModel):
    """Solver limits for one preview."""

    model_config = ConfigDict(extra="forbid")

    time_limit_s: float = Field(10.0, gt=0, le=120)
    mip_rel_gap: float = Field(0.005, ge=0, le=0.5)


class PlanView(BaseModel):
    id: str
    status: str
    base_plan_id: str | None
    cost_per_hour: float | None
    assignments: list[dict[str, Any]]
    diff: dict[str, Any]
    explanation: str | None
    solve_seconds: float
    created_at: datetime
    created_by: str
    applied_at: datetime | None
    applied_by: str | None

    @classmethod
    def of(cls, row: PlacementPlan) -> PlanView:
        return cls(
            id=row.id,
            status=row.status,
            base_plan_id=row.base_plan_id,
            cost_per_hour=row.cost_per_hour,
            assignments=list(row.assignments),
            diff=dict(row.diff),
            explanation=row.explanation,
            solve_seconds=row.solve_seconds,
            created_at=row.created_at,
            created_by=row.created_by,
            applied_at=row.applied_at,
            applied_by=row.applied_by,
        )


@router.post("/plans", status_code=201)
async def preview_plan(ctx: Ctx, actor: OperatorActor, body: PlanRequest | None = None) -> PlanView:
    """Solve a placement of every deployment against the one in force; kept as a preview.

    An infeasible problem is answered 201 too, with status "infeasible" and an explanation
    naming the constraints that cannot be met: the plan is a record, not an error.
    """
    limits = body or PlanRequest()
    options = SolveOptions(time_limit_s=limits.time_limit_s, mip_rel_gap=limits.mip_rel_gap)

    def read() -> planner.PlanningState:
        with ctx.read() as session:
            return planner.read_state(session, ctx.catalog, ctx.regions)

    state = await asyncio.to_thread(read)
    result = await asyncio.to_thread(planner.solve_state, state, options)

    def store() -> PlanView:
        with ctx.write() as session:
            return PlanView.of(planner.store_plan(session, state, result, actor, datetime.now(UTC)))

    return await asyncio.to_thread(store)


@router.get("/plans", dependencies=readers)
def list_plans(
    ctx: Ctx, request: Request, response: Response, page: Annotated[PageParams, Depends(page_params)]
) -> list[PlanView]:
    """Plans, newest first."""
    with ctx.read() as session:
        rows, next_cursor = paginate(
            session, select(PlacementPlan), [PlacementPlan.created_at, PlacementPlan.id], page, descending=True
        )
        views = [PlanView.of(r) for r in rows]
    set_next_link(request, response, next_cursor)
    return views


@router.get("/current", dependencies=readers)
def current_placement(ctx: Ctx) -> PlanView:
    """The applied plan: the placement in force."""
    with ctx.read() as session:
        row = planner.current_plan(session)
        if row is None:
            raise NotFound("no placement has been applied yet; preview and apply a plan")
        return PlanView.of(row)


@router.get("/plans/{plan_id}", dependencies=readers)
def get_plan(ctx: Ctx, plan_id: PlanIdParam) -> PlanView:
    with ctx.read() as session:
        return PlanView.of(planner.get_plan(session, plan_id))


@router.post("/plans/{plan_id}/apply")
def apply_plan(ctx: Ctx, actor: OperatorActor, plan_id: PlanIdParam) -> PlanView:
    """Put a previewed plan in force (409 when another plan was applied since it was solved)."""
    try:
        with ctx.write() as session:
            return PlanView.of(planner.apply_plan(session, plan_id, actor, datetime.now(UTC)))
    except IntegrityError as e:
        raise Conflict("another plan was applied concurrently; preview a new plan") from e
