"""Admin API for API keys: create (key shown once), list (no secrets), revoke."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from control_plane import audit, keystore, tenant_store
from control_plane.api.pagination import PageParams, page_params, paginate, set_next_link
from control_plane.api.tenants import TENANT_PATTERN, TenantCreate, create_audited, known_zone
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_scopes
from control_plane.db.models import ApiKey
from control_plane.errors import BadRequest, Conflict
from control_plane.scopes import Scope
from meridian.contracts import GLOBAL_ZONE, PRINTABLE_PATTERN, ModelName, ZoneName, allows_model

router = APIRouter(prefix="/v1", dependencies=[Depends(require_scopes([Scope.ADMIN]))])
AdminActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN]))]
KeyIdParam = Annotated[str, Path(min_length=1, max_length=36)]


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Shown in listings, the audit log and logs: no control characters (CR/LF forge lines).
    name: str = Field(min_length=1, max_length=200, pattern=PRINTABLE_PATTERN)
    tenant: str = Field(pattern=TENANT_PATTERN)
    # The tenant's zone when left out; a new tenant is created in this zone (default global).
    zone: ZoneName | None = None
    scopes: list[Scope] = Field(min_length=1, max_length=len(Scope))
    models: list[ModelName] | None = Field(None, max_length=64)

    @field_validator("scopes")
    @classmethod
    def _unique(cls, v: list[Scope]) -> list[Scope]:
        return sorted(set(v))


class ApiKeyView(BaseModel):
    """A key as listings show it: never the key itself."""

    id: str
    name: str
    tenant: str
    zone: str
    scopes: list[Scope]
    models: list[str] | None
    key_prefix: str
    created_at: datetime
    revoked_at: datetime | None = None

    @classmethod
    def of(cls, row: ApiKey) -> ApiKeyView:
        return cls(
            id=row.id,
            name=row.name,
            tenant=row.tenant,
            zone=row.zone,
            scopes=[Scope(s) for s in row.scopes],
            models=row.models,
            key_prefix=row.key_prefix,
            created_at=row.created_at,
            revoked_at=row.revoked_at,
        )


class ApiKeyCreated(ApiKeyView):
    """The answer to a creation: the only time the plaintext key is ever shown."""

    key: str


def _key_audit(row: ApiKey) -> dict[str, object]:
    return ApiKeyView.of(row).model_dump(mode="json")


@router.post("/api-keys", status_code=201)
def create_api_key(ctx: Ctx, actor: AdminActor, body: ApiKeyCreate) -> ApiKeyCreated:
    """Create a key bound to its tenant's zone (creating the tenant if new); shown once."""
    now = ctx.clock.now()
    try:
        with ctx.write() as session:
            tenant = tenant_store.find(session, body.tenant)
            if tenant is None:
                zone = known_zone(ctx, body.zone or GLOBAL_ZONE)
                tenant = create_audited(session, actor, TenantCreate(name=body.tenant, zone=zone), now)
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
                zone=tenant.zone,
                scopes=body.scopes,
                models=body.models,
                now=now,
            )
            view = ApiKeyView.of(row)
            audit.record(session, actor, action="create", resource_type="api_key", resource_id=row.id,
                         before=None, after=view.model_dump(mode="json"), now=now)
    except IntegrityError as e:
        raise Conflict(f"tenant {body.tenant!r} was created concurrently; retry") from e
    return ApiKeyCreated(key=plaintext, **view.model_dump())


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
    with ctx.read() as session:
        rows, next_cursor = paginate(session, query, [ApiKey.created_at, ApiKey.id], page)
        views = [ApiKeyView.of(r) for r in rows]
    set_next_link(request, response, next_cursor)
    return views


@router.get("/api-keys/{key_id}")
def get_api_key(ctx: Ctx, key_id: KeyIdParam) -> ApiKeyView:
    with ctx.read() as session:
        return ApiKeyView.of(keystore.get_key(session, key_id))


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
