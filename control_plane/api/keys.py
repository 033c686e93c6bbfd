"""Admin API for API keys: create (key shown once), list (no secrets), revoke."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from control_plane import keystore
from control_plane.auth import Ctx, require_scopes
from control_plane.db.models import ApiKey
from control_plane.errors import BadRequest
from control_plane.scopes import Scope
from meridian.contracts import GLOBAL_ZONE, ModelName, ZoneName

router = APIRouter(prefix="/v1", dependencies=[Depends(require_scopes([Scope.ADMIN]))])


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    tenant: str = Field(min_length=1, max_length=200)
    zone: ZoneName = GLOBAL_ZONE
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


@router.post("/api-keys", status_code=201)
def create_api_key(ctx: Ctx, body: ApiKeyCreate) -> ApiKeyCreated:
    known_zones = {z for r in ctx.regions.values() for z in r.zones} | {GLOBAL_ZONE}
    if body.zone not in known_zones:
        raise BadRequest(f"unknown zone {body.zone!r}; known: {', '.join(sorted(known_zones))}")
    with ctx.write() as session:
        row, plaintext = keystore.create_key(
            session,
            name=body.name,
            tenant=body.tenant,
            zone=body.zone,
            scopes=body.scopes,
            models=body.models,
            now=datetime.now(UTC),
        )
    return ApiKeyCreated(key=plaintext, **ApiKeyView.of(row).model_dump())


@router.get("/api-keys")
def list_api_keys(ctx: Ctx, include_revoked: Annotated[bool, Query()] = False) -> list[ApiKeyView]:
    with ctx.read() as session:
        return [ApiKeyView.of(r) for r in keystore.list_keys(session, include_revoked=include_revoked)]


@router.delete("/api-keys/{key_id}", status_code=204)
def revoke_api_key(ctx: Ctx, key_id: str) -> Response:
    with ctx.write() as session:
        keystore.revoke_key(session, key_id, datetime.now(UTC))
    return Response(status_code=204)
