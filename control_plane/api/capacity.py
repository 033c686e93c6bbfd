"""GPU capacity per (region, SKU): explicit limits set by operators over the on-prem inventory's."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import IntegrityError

from control_plane import audit, capacity_store
from control_plane.api.etags import check_if_match, check_put_preconditions, set_etag
from control_plane.api.pagination import PageParams, page_params, paginate_items, set_next_link
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_scopes
from control_plane.capacity_store import EffectiveCapacity
from control_plane.context import AppContext
from control_plane.errors import BadRequest, Conflict
from control_plane.scopes import FLEET_READERS, Scope
from meridian.contracts import REGION_PATTERN
from providers.skus import UnknownGpuError, normalise_gpu_name

router = APIRouter(prefix="/v1", tags=["capacity"])
OperatorActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN, Scope.OPERATOR]))]
fleet_readers = [Depends(require_scopes(FLEET_READERS))]
SKU_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9.-]{0,31}$"
RegionParam = Annotated[str, Path(pattern=REGION_PATTERN, examples=["onprem:tokyo-1", "aws:us-east-1"])]
SkuParam = Annotated[str, Path(pattern=SKU_PATTERN, description="a canonical SKU", examples=["H100-80GB-SXM"])]


class CapacityPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_gpus: int = Field(ge=0, le=1_000_000, description="GPUs of the SKU Meridian may run in the region")


class CapacityView(BaseModel):
    """An effective limit: explicit (an operator's, with an ETag) or the on-prem inventory's."""

    region: str
    sku: str
    max_gpus: int
    source: Literal["explicit", "inventory"]
    resource_version: int | None = None
    updated_at: datetime | None = None

    @classmethod
    def of(cls, entry: EffectiveCapacity) -> CapacityView:
        return cls.model_validate(dataclasses.asdict(entry))


def canonical_sku(ctx: AppContext, sku: str) -> str:
    """`sku` if it is a canonical catalog SKU, else 400 (naming the canonical spelling when there is one)."""
    if sku in ctx.catalog.skus:
        return sku
    try:
        hint = f"; did you mean {normalise_gpu_name(sku).name!r}?"
    except UnknownGpuError:
        hint = f"; known: {', '.join(sorted(ctx.catalog.skus))}"
    raise BadRequest(f"{sku!r} is not a canonical SKU{hint}")


def known_region(ctx: AppContext, region: str) -> str:
    """`region` if the control plane knows it, else 400."""
    if region not in ctx.regions:
        raise BadRequest(f"unknown region {region!r}")
    return region


def _resource_id(region: str, sku: str) -> str:
    return f"{region}/{sku}"


@router.get("/capacity", dependencies=fleet_readers)
def list_capacity(
    ctx: Ctx,
    request: Request,
    response: Response,
    page: Annotated[PageParams, Depends(page_params)],
    region: Annotated[str | None, Query(pattern=REGION_PATTERN)] = None,
    sku: Annotated[str | None, Query(pattern=SKU_PATTERN)] = None,
) -> list[CapacityView]:
    """Effective limits by region and SKU: explicit rows, and on-prem inventory defaults where none."""
    with ctx.read() as session:
        entries = capacity_store.effective(session, ctx.catalog)
    entries = [e for e in entries if (region is None or e.region == region) and (sku is None or e.sku == sku)]
    rows, next_cursor = paginate_items(entries, lambda e: (e.region, e.sku), page)
    set_next_link(request, response, next_cursor)
    return [CapacityView.of(e) for e in rows]


@router.get("/capacity/{region}/{sku}", dependencies=fleet_readers)
def get_capacity(ctx: Ctx, region: RegionParam, sku: SkuParam, response: Response) -> CapacityView:
    with ctx.read() as session:
        entry = capacity_store.effective_one(session, ctx.catalog, region, sku)
    if entry.resource_version is not None:
        set_etag(response, entry.resource_version)
    return CapacityView.of(entry)


@router.put("/capacity/{region}/{sku}")
def put_capacity(
    ctx: Ctx,
    actor: OperatorActor,
    region: RegionParam,
    sku: SkuParam,
    body: CapacityPut,
    response: Response,
    if_match: Annotated[str | None, Header()] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> CapacityView:
    """Set the limit of a SKU in a region (canonical SKU, known region). If-Match: its ETag;
    If-None-Match: * sets it only if no explicit limit exists."""
    known_region(ctx, region)
    canonical_sku(ctx, sku)
    now = ctx.clock.now()
    rid = _resource_id(region, sku)
    try:
        with ctx.write() as session:
            existing = capacity_store.find(session, region, sku, for_update=True)
            check_put_preconditions(
                if_match, if_none_match, existing.resource_version if existing else None,
                f"an explicit limit for {sku} in {region}",
            )
            before = capacity_store.as_dict(existing) if existing else None
            saved = capacity_store.put(session, region, sku, body.max_gpus, now, existing)
            if saved.changed:
                audit.record(session, actor, action="create" if saved.created else "update",
                             resource_type="capacity", resource_id=rid, before=before,
                             after=capacity_store.as_dict(saved.row), now=now)
            view = CapacityView.of(EffectiveCapacity.of(saved.row))
    except IntegrityError as e:
        raise Conflict(f"the limit for {sku} in {region} was set concurrently; retry") from e
    response.status_code = 201 if saved.created else 200
    set_etag(response, saved.row.resource_version)
    return view


@router.delete("/capacity/{region}/{sku}", status_code=204)
def delete_capacity(
    ctx: Ctx,
    actor: OperatorActor,
    region: RegionParam,
    sku: SkuParam,
    if_match: Annotated[str | None, Header()] = None,
) -> Response:
    """Remove an explicit limit; the inventory's default (or none) applies again."""
    now = ctx.clock.now()
    with ctx.write() as session:
        row = capacity_store.get(session, region, sku, for_update=True)
        check_if_match(if_match, row.resource_version)
        before = capacity_store.as_dict(row)
        capacity_store.delete(session, row)
        audit.record(session, actor, action="delete", resource_type="capacity",
                     resource_id=_resource_id(region, sku), before=before, after=None, now=now)
    return Response(status_code=204)
