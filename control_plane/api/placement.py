"""Placement plans: preview (solve against the placement in force, with its diff), list, apply."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from control_plane import planner
from control_plane.api.pagination import PageParams, list_page, page_params
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_scopes
from control_plane.db.models import Deployment, PlacementPlan
from control_plane.errors import BadRequest, Conflict, NotFound
from control_plane.infra_export import InfraExportError, InfraOptions, infra_plan
from control_plane.placement.problem import SolveOptions
from control_plane.scopes import FLEET_READERS, Scope
from meridian.admin_api import PlanRequest, PlanView
from meridian.infra_plan import KubernetesTarget

router = APIRouter(prefix="/v1/placement", tags=["placement"])
readers = [Depends(require_scopes(FLEET_READERS))]
OperatorActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN, Scope.OPERATOR]))]
PlanIdParam = Annotated[str, Path(min_length=1, max_length=36)]


class InfraRequest(BaseModel):
    """What the placement does not know about the infrastructure (see control_plane.infra_export)."""

    model_config = ConfigDict(extra="forbid")

    control_plane_url: str = Field(pattern=r"^https?://", max_length=500)
    endpoint_domain: str = Field(min_length=3, max_length=253)
    dns_zone: str = Field(min_length=3, max_length=253)
    global_region: str = Field(min_length=3, max_length=80)
    router_addresses: list[str] = Field(default_factory=list, max_length=64)
    name: str = Field("meridian", min_length=1, max_length=63)
    agent_package: str = Field("meridian", min_length=1, max_length=200)
    kubernetes_sites: dict[str, KubernetesTarget] = Field(default_factory=dict, max_length=256)
    max_scale: float = Field(2.0, ge=1, le=100)


def plan_view(row: PlacementPlan) -> PlanView:
    return PlanView.model_validate(row, from_attributes=True)


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
            return planner.read_state(session, ctx.catalog, ctx.regions, ctx.enabled_providers)

    state = await asyncio.to_thread(read)
    result = await asyncio.to_thread(planner.solve_state, state, options)

    def store() -> PlanView:
        with ctx.write() as session:
            return plan_view(planner.store_plan(session, state, result, actor, ctx.clock.now()))

    return await asyncio.to_thread(store)


@router.get("/plans", dependencies=readers)
def list_plans(
    ctx: Ctx, request: Request, response: Response, page: Annotated[PageParams, Depends(page_params)]
) -> list[PlanView]:
    """Plans, newest first."""
    return list_page(
        ctx, request, response, page, select(PlacementPlan), [PlacementPlan.created_at, PlacementPlan.id], plan_view,
        descending=True,
    )


@router.get("/current", dependencies=readers)
def current_placement(ctx: Ctx) -> PlanView:
    """The applied plan: the placement in force."""
    with ctx.read() as session:
        row = planner.current_plan(session)
        if row is None:
            raise NotFound("no placement has been applied yet; preview and apply a plan")
        return plan_view(row)


@router.get("/plans/{plan_id}", dependencies=readers)
def get_plan(ctx: Ctx, plan_id: PlanIdParam) -> PlanView:
    with ctx.read() as session:
        return plan_view(planner.get_plan(session, plan_id))


@router.post("/plans/{plan_id}/infra", dependencies=readers)
def infra_of_plan(ctx: Ctx, plan_id: PlanIdParam, body: InfraRequest) -> dict[str, Any]:
    """The plan as an infrastructure plan, the file `meridian iac synth --plan` reads."""
    options = InfraOptions(
        control_plane_url=body.control_plane_url, endpoint_domain=body.endpoint_domain,
        dns_zone=body.dns_zone, global_region=body.global_region,
        router_addresses=tuple(body.router_addresses), name=body.name, agent_package=body.agent_package,
        kubernetes_sites=body.kubernetes_sites, max_scale=body.max_scale,
    )
    with ctx.read() as session:
        plan = planner.get_plan(session, plan_id)
        zones = {d.model: d.zone for d in session.scalars(select(Deployment)).all()}
        assignments = [planner.assignment_of(a) for a in plan.assignments]
    try:
        infra = infra_plan(assignments, zones, ctx.regions, ctx.catalog, options, plan_id=plan_id)
    except (InfraExportError, ValidationError) as e:
        raise BadRequest(f"plan {plan_id} cannot be written as infrastructure: {_first_error(e)}") from e
    return infra.model_dump(mode="json", by_alias=True)


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        return str(err.get("ctx", {}).get("error") or err["msg"])
    return str(e)


@router.post("/plans/{plan_id}/apply")
def apply_plan(ctx: Ctx, actor: OperatorActor, plan_id: PlanIdParam) -> PlanView:
    """Put the newest preview in force (409 when a newer plan was previewed or applied since it was
    solved, or when it places node groups on a provider this control plane has no driver for)."""
    try:
        with ctx.write() as session:
            return plan_view(planner.apply_plan(session, plan_id, actor, ctx.clock.now(), ctx.enabled_providers))
    except IntegrityError as e:
        raise Conflict("another plan was applied concurrently; preview a new plan") from e
