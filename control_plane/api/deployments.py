"""Deployments: managed by operators, read by the fleet, scaled up by routers (cluster token)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy.exc import IntegrityError

from control_plane import deployment_store
from control_plane.auth import Ctx, require_cluster_token, require_scopes
from control_plane.errors import BadRequest, Conflict
from control_plane.scopes import FLEET_READERS, Scope
from meridian.contracts import GLOBAL_ZONE, DeploymentView, ScaleUpRequest, ZoneName

router = APIRouter(prefix="/v1")
operators = [Depends(require_scopes([Scope.ADMIN, Scope.OPERATOR]))]
fleet_readers = [Depends(require_scopes(FLEET_READERS))]
internal = [Depends(require_cluster_token)]
# Model names may contain '/' ("org/name"), so the path parameter takes the rest of the path.
ModelParam = Annotated[str, Path(min_length=1, max_length=200)]


class DeploymentUpsert(BaseModel):
    """The body of PUT /v1/deployments/{model}."""

    model_config = ConfigDict(extra="forbid")

    zone: ZoneName = GLOBAL_ZONE
    min_replicas: int = Field(0, ge=0, le=1000)
    max_replicas: int = Field(1, ge=1, le=1000)

    @model_validator(mode="after")
    def _bounds(self) -> DeploymentUpsert:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


# Declared before the catch-all {model:path} routes so that ".../scale-up" is not a model name.
@router.post("/deployments/{model:path}/scale-up", dependencies=internal)
def scale_up(ctx: Ctx, model: ModelParam, body: ScaleUpRequest) -> DeploymentView:
    """Raise the deployment to at least one replica (idempotent); routers call it."""
    with ctx.write() as session:
        row = deployment_store.request_scale_up(session, model, body, ctx.regions, datetime.now(UTC))
        return deployment_store.view(row)


@router.put("/deployments/{model:path}", dependencies=operators)
def put_deployment(ctx: Ctx, model: ModelParam, body: DeploymentUpsert, response: Response) -> DeploymentView:
    known_zones = {z for r in ctx.regions.values() for z in r.zones} | {GLOBAL_ZONE}
    if body.zone not in known_zones:
        raise BadRequest(f"unknown zone {body.zone!r}; known: {', '.join(sorted(known_zones))}")
    try:
        with ctx.write() as session:
            row, created = deployment_store.upsert(
                session,
                model,
                zone=body.zone,
                min_replicas=body.min_replicas,
                max_replicas=body.max_replicas,
                now=datetime.now(UTC),
            )
            view = deployment_store.view(row)
    except IntegrityError as e:
        raise Conflict(f"deployment {model!r} was created concurrently; retry") from e
    response.status_code = 201 if created else 200
    return view


@router.get("/deployments", dependencies=fleet_readers)
def list_deployments(ctx: Ctx) -> list[DeploymentView]:
    with ctx.read() as session:
        return [deployment_store.view(r) for r in deployment_store.list_deployments(session)]


@router.get("/deployments/{model:path}", dependencies=fleet_readers)
def get_deployment(ctx: Ctx, model: ModelParam) -> DeploymentView:
    with ctx.read() as session:
        return deployment_store.view(deployment_store.get(session, model))


@router.delete("/deployments/{model:path}", dependencies=operators, status_code=204)
def delete_deployment(ctx: Ctx, model: ModelParam) -> Response:
    with ctx.write() as session:
        deployment_store.delete(session, model)
    return Response(status_code=204)
