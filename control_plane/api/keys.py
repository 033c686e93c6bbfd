"""Admin API for API keys: create (key shown once; for a tenant that exists, or one created with it
on purpose), list (no secrets), revoke."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane import audit, keystore, tenant_store
from control_plane.api.pagination import PageParams, list_page, page_params
from control_plane.api.tenants import create_audited, known_zone
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_scopes
from control_plane.db.models import ApiKey
from control_plane.errors import BadRequest, Conflict, NotFound
from control_plane.scopes import Scope
from meridian.admin_api import TENANT_PATTERN, ApiKeyCreate, ApiKeyCreated, ApiKeyView, TenantCreate
from meridian.contracts import allows_model

router = APIRouter(prefix="/v1", dependencies=[Depends(require_scopes([Scope.ADMIN]))], tags=["keys"])
AdminActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN]))]
KeyIdParam = Annotated[str, Path(min_length=1, max_length=36)]


def key_view(row: ApiKey) -> ApiKeyView:
    """A key row as the API shows it (never its hash)."""
    return ApiKeyView.model_validate(row, from_attributes=True)


def _key_audit(row: ApiKey) -> dict[str, object]:
    return key_view(row).model_dump(mode="json")


@router.post("/api-keys", status_code=201)
def create_api_key(ctx: Ctx, actor: AdminActor, body: ApiKeyCreate) -> ApiKeyCreated:
    """Create a key bound to its tenant's zone; shown once. An unknown tenant is 404, unless
    create_tenant creates it (in `zone`) in the same transaction."""
    now = ctx.clock.now()
    if body.create_tenant and body.zone is not None:
        known_zone(ctx, body.zone)
    try:
        with ctx.write() as session:
            tenant = tenant_store.find(session, body.tenant)
            created = tenant is None
            if tenant is None:
                if not body.create_tenant or body.zone is None:
                    raise NotFound(_no_tenant(session, body.tenant))
                tenant = create_audited(session, actor, TenantCreate(name=body.tenant, zone=body.zone), now)
            elif body.zone is not None and body.zone != tenant.zone:
                raise Conflict(
                    f"tenant {tenant.name!r} is bound to zone {tenant.zone!r}; its keys take that zone "
                    "(change the tenant's zone instead)"
                )
            if body.models is not None and tenant.models is not None:
                outside = sorted(m for m in body.models if not allows_model(tenant.models, m))
                if outside:
                    raise BadRequest(f"models not allowed for tenant {tenant.name!r}: {', '.join(outside)}")
            row, plaintext = keystore.create_key(
                session,
                name=body.name,
                tenant=tenant.name,
                scopes=body.scopes,
                models=body.models,
                priority=body.priority,
                now=now,
            )
            view = key_view(row)
            audit.record(session, actor, action="create", resource_type="api_key", resource_id=row.id,
                         before=None, after=view.model_dump(mode="json"), now=now)
    except IntegrityError as e:
        raise Conflict(f"tenant {body.tenant!r} was created concurrently; retry") from e
    return ApiKeyCreated(key=plaintext, tenant_created=created, **view.model_dump())


def _no_tenant(session: Session, name: str) -> str:
    close = tenant_store.close_names(session, name)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"no tenant {name!r}{hint}; create it first (POST /v1/tenants), or send create_tenant "
            "with its zone")


@router.get("/api-keys")
def list_api_keys(
    ctx: Ctx,
    request: Request,
    response: Response,
    page: Annotated[PageParams, Depends(page_params)],
    include_revoked: Annotated[bool, Query()] = False,
    tenant: Annotated[str | None, Query(pattern=TENANT_PATTERN)] = None,
) -> list[ApiKeyView]:
    query = select(ApiKey)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    return list_page(ctx, request, response, page, query, [ApiKey.created_at, ApiKey.id], key_view)


@router.get("/api-keys/{key_id}")
def get_api_key(ctx: Ctx, key_id: KeyIdParam) -> ApiKeyView:
    with ctx.read() as session:
        return key_view(keystore.get_key(session, key_id))


@router.delete("/api-keys/{key_id}", status_code=204)
def revoke_api_key(ctx: Ctx, actor: AdminActor, key_id: KeyIdParam) -> Response:
    now = ctx.clock.now()
    with ctx.write() as session:
        row = keystore.get_key(session, key_id, for_update=True)
        before = _key_audit(row)
        if keystore.revoke_key(session, key_id, now):
            audit.record(session, actor, action="revoke", resource_type="api_key", resource_id=key_id,
                         before=before, after=_key_audit(row), now=now)
    return Response(status_code=204)
