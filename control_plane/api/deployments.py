"""Deployments: managed by operators, read by the fleet, scaled up by routers (cluster token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from control_plane import audit, deployment_store, model_store
from control_plane.api.etags import check_if_match, check_put_preconditions, set_etag
from control_plane.api.models import put_audited
from control_plane.api.pagination import PageParams, list_page, page_params
from control_plane.api.tenants import known_zone
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_cluster_token, require_scopes
from control_plane.db.models import Deployment
from control_plane.errors import BadRequest, Conflict
from control_plane.scopes import FLEET_READERS, Scope
from meridian.admin_api import DeploymentUpsert
from meridian.contracts import PRINTABLE_PATTERN, DeploymentView, DisaggregationSpec, ScaleUpRequest

router = APIRouter(prefix="/v1", tags=["deployments"])
OperatorActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN, Scope.OPERATOR]))]
fleet_readers = [Depends(require_scopes(FLEET_READERS))]
internal = [Depends(require_cluster_token)]
# Model names may contain '/' ("org/name"), so the path parameter takes the rest of the path.
ModelParam = Annotated[str, Path(min_length=1, max_length=200, pattern=PRINTABLE_PATTERN)]


# Declared before the catch-all {model:path} routes so that ".../scale-up" is not a model name.
@router.post("/deployments/{model:path}/scale-up", dependencies=internal)
def scale_up(ctx: Ctx, model: ModelParam, body: ScaleUpRequest) -> DeploymentView:
    """Raise the deployment to at least one replica (idempotent); routers call it."""
    with ctx.write() as session:
        row = deployment_store.request_scale_up(session, model, body, ctx.regions, ctx.clock.now())
        return deployment_store.view(row)


@router.put("/deployments/{model:path}")
def put_deployment(
    ctx: Ctx,
    actor: OperatorActor,
    model: ModelParam,
    body: DeploymentUpsert,
    response: Response,
    if_match: Annotated[str | None, Header()] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> DeploymentView:
    """Create or replace a deployment (and, given `model`, register the model's spec, in the same
    transaction). If-Match: its ETag (412 if it changed meanwhile); If-None-Match: * creates
    only (412 if it exists)."""
    known_zone(ctx, body.zone)
    for field, regions in (("demand", body.placement.demand), ("replicas", body.placement.replicas)):
        unknown = sorted(r for r in regions if r not in ctx.regions)
        if unknown:
            raise BadRequest(f"placement.{field} names unknown regions: {', '.join(unknown)}")
    if body.disaggregation is not None:
        _check_pools(ctx, body.zone, body.disaggregation)
    now = ctx.clock.now()
    try:
        with ctx.write() as session:
            existing = deployment_store.find(session, model, for_update=True)
            check_put_preconditions(
                if_match, if_none_match, existing.resource_version if existing else None, f"deployment {model!r}"
            )
            before = deployment_store.as_dict(existing) if existing else None
            if body.model is not None:
                put_audited(session, actor, model, body.model, now, model_store.find(session, model, for_update=True))
            row, created, changed = deployment_store.upsert(
                session,
                model,
                zone=body.zone,
                min_replicas=body.min_replicas,
                max_replicas=body.max_replicas,
                placement=body.placement,
                autoscaling=body.autoscaling,
                disaggregation=body.disaggregation,
                now=now,
                row=existing,
            )
            view = deployment_store.view(row)
            after = view.model_dump(mode="json")
            if changed:
                audit.record(session, actor, action="create" if created else "update",
                             resource_type="deployment", resource_id=model, before=before, after=after, now=now)
    except IntegrityError as e:
        raise Conflict(f"deployment {model!r} (or its model) was created concurrently; retry") from e
    response.status_code = 201 if created else 200
    set_etag(response, view.resource_version)
    return view


def _check_pools(ctx: Ctx, zone: str, spec: DisaggregationSpec) -> None:
    """Pools go only to known regions of the deployment's zone: residency is a hard filter."""
    unknown = sorted(r for r in spec.pools if r not in ctx.regions)
    if unknown:
        raise BadRequest(f"disaggregation.pools names unknown regions: {', '.join(unknown)}")
    outside = sorted(r for r in spec.pools if not ctx.regions[r].admits(zone))
    if outside:
        raise BadRequest(f"disaggregation.pools names regions outside zone {zone!r}: {', '.join(outside)}")


@router.get("/deployments", dependencies=fleet_readers)
def list_deployments(
    ctx: Ctx, request: Request, response: Response, page: Annotated[PageParams, Depends(page_params)]
) -> list[DeploymentView]:
    return list_page(ctx, request, response, page, select(Deployment), [Deployment.model], deployment_store.view)


@router.get("/deployments/{model:path}", dependencies=fleet_readers)
def get_deployment(ctx: Ctx, model: ModelParam, response: Response) -> DeploymentView:
    with ctx.read() as session:
        view = deployment_store.view(deployment_store.get(session, model))
    set_etag(response, view.resource_version)
    return view


@router.delete("/deployments/{model:path}", status_code=204)
def delete_deployment(
    ctx: Ctx, actor: OperatorActor, model: ModelParam, if_match: Annotated[str | None, Header()] = None
) -> Response:
    now = ctx.clock.now()
    with ctx.write() as session:
        row = deployment_store.get(session, model, for_update=True)
        check_if_match(if_match, row.resource_version)
        before = deployment_store.as_dict(row)
        deployment_store.delete(session, row)
        audit.record(session, actor, action="delete", resource_type="deployment", resource_id=model,
                     before=before, after=None, now=now)
    return Response(status_code=204)
