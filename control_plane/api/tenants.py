"""Tenants: residency zone, allowed models, rate limits and flow control's priority and weight,
inherited by every key of the tenant (a key may override the priority)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane import audit, tenant_store
from control_plane.api.etags import check_if_match, set_etag
from control_plane.api.pagination import PageParams, list_page, page_params
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_scopes
from control_plane.db.models import Tenant
from control_plane.errors import BadRequest, Conflict
from control_plane.scopes import FLEET_READERS, Scope
from meridian import residency
from meridian.admin_api import TENANT_PATTERN, TenantCreate, TenantPatch, TenantView
from meridian.contracts import DEFAULT_PRIORITY, DEFAULT_TENANT_WEIGHT

router = APIRouter(prefix="/v1", tags=["tenants"])
readers = [Depends(require_scopes(FLEET_READERS))]
AdminActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN]))]
TenantParam = Annotated[str, Path(pattern=TENANT_PATTERN)]


def tenant_view(row: Tenant) -> TenantView:
    return TenantView.model_validate(tenant_store.as_dict(row))


def known_zone(ctx: Ctx, zone: str) -> str:
    """`zone` if some region belongs to it (or it is global), else 400."""
    known = residency.known_zones(ctx.regions.values())
    if zone not in known:
        raise BadRequest(f"unknown zone {zone!r}; known: {', '.join(sorted(known))}")
    return zone


def create_audited(session: Session, actor: Actor, body: TenantCreate, now: datetime) -> Tenant:
    """Add a tenant and its audit entry to the caller's transaction (409 when the name is taken)."""
    row = tenant_store.create(
        session,
        body.name,
        zone=body.zone,
        models=body.models,
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
        cache_group=body.cache_group,
        priority=body.priority,
        weight=body.weight,
        now=now,
    )
    audit.record(session, actor, action="create", resource_type="tenant", resource_id=row.name,
                 before=None, after=tenant_store.as_dict(row), now=now)
    return row


@router.post("/tenants", status_code=201)
def create_tenant(ctx: Ctx, actor: AdminActor, body: TenantCreate, response: Response) -> TenantView:
    known_zone(ctx, body.zone)
    now = ctx.clock.now()
    try:
        with ctx.write() as session:
            view = tenant_view(create_audited(session, actor, body, now))
    except IntegrityError as e:
        # Postgres lets two creators past the existence check; the second insert loses.
        raise Conflict(f"tenant {body.name!r} already exists") from e
    set_etag(response, view.resource_version)
    return view


@router.get("/tenants", dependencies=readers)
def list_tenants(
    ctx: Ctx, request: Request, response: Response, page: Annotated[PageParams, Depends(page_params)]
) -> list[TenantView]:
    return list_page(ctx, request, response, page, select(Tenant), [Tenant.name], tenant_view)


@router.get("/tenants/{name}", dependencies=readers)
def get_tenant(ctx: Ctx, name: TenantParam, response: Response) -> TenantView:
    with ctx.read() as session:
        view = tenant_view(tenant_store.get(session, name))
    set_etag(response, view.resource_version)
    return view


@router.patch("/tenants/{name}")
def patch_tenant(
    ctx: Ctx,
    actor: AdminActor,
    name: TenantParam,
    body: TenantPatch,
    response: Response,
    if_match: Annotated[str | None, Header()] = None,
) -> TenantView:
    changes: dict[str, Any] = body.model_dump(exclude_unset=True)
    if "zone" in changes:
        if changes["zone"] is None:
            raise BadRequest("zone cannot be null; use 'global' for no residency constraint")
        known_zone(ctx, changes["zone"])
    # Not limits to clear: every tenant has a band and a weight (the columns are NOT NULL).
    for field, default in (("priority", DEFAULT_PRIORITY), ("weight", DEFAULT_TENANT_WEIGHT)):
        if field in changes and changes[field] is None:
            raise BadRequest(f"{field} cannot be null; use {default:g} for the default")
    now = ctx.clock.now()
    with ctx.write() as session:
        row = tenant_store.get(session, name, for_update=True)
        check_if_match(if_match, row.resource_version)
        before = tenant_store.as_dict(row)
        if tenant_store.update_fields(session, row, changes, now):
            audit.record(session, actor, action="update", resource_type="tenant", resource_id=name,
                         before=before, after=tenant_store.as_dict(row), now=now)
        view = tenant_view(row)
    set_etag(response, view.resource_version)
    return view


@router.delete("/tenants/{name}", status_code=204)
def delete_tenant(
    ctx: Ctx, actor: AdminActor, name: TenantParam, if_match: Annotated[str | None, Header()] = None
) -> Response:
    """Delete the tenant; every key of it is revoked in the same transaction."""
    now = ctx.clock.now()
    with ctx.write() as session:
        row = tenant_store.get(session, name, for_update=True)
        check_if_match(if_match, row.resource_version)
        before = tenant_store.as_dict(row)
        revoked = tenant_store.delete(session, row, now)
        audit.record(session, actor, action="delete", resource_type="tenant", resource_id=name,
                     before=before, after={"keys_revoked": revoked}, now=now)
    return Response(status_code=204)
