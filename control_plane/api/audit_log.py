"""The audit log, newest first: every change made through the admin API or by the control plane's loops."""

from __future__ import annotations

from datetime import UTC
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import AwareDatetime
from sqlalchemy import select

from control_plane.api.pagination import PageParams, list_page, page_params
from control_plane.auth import Ctx, require_scopes
from control_plane.db.models import AuditEntry
from control_plane.errors import BadRequest
from control_plane.scopes import FLEET_READERS
from meridian.admin_api import AuditEntryView
from meridian.contracts import PRINTABLE_PATTERN

# Readers of the fleet may read it: entries hold no secrets (an API key's entry has neither the
# key nor its hash).
router = APIRouter(prefix="/v1", dependencies=[Depends(require_scopes(FLEET_READERS))], tags=["audit"])


@router.get("/audit")
def list_audit_entries(
    ctx: Ctx,
    request: Request,
    response: Response,
    page: Annotated[PageParams, Depends(page_params)],
    resource_type: Annotated[str | None, Query(pattern=r"^[a-z_]{1,32}$")] = None,
    resource_id: Annotated[str | None, Query(min_length=1, max_length=256, pattern=PRINTABLE_PATTERN)] = None,
    actor_id: Annotated[str | None, Query(min_length=1, max_length=64, pattern=PRINTABLE_PATTERN)] = None,
    since: Annotated[AwareDatetime | None, Query(description="entries at or after this instant")] = None,
) -> list[AuditEntryView]:
    """Entries newest first, optionally of one resource (type, id), one actor, or since an instant."""
    query = select(AuditEntry)
    if resource_type is not None:
        query = query.where(AuditEntry.resource_type == resource_type)
    if resource_id is not None:
        query = query.where(AuditEntry.resource_id == resource_id)
    if actor_id is not None:
        query = query.where(AuditEntry.actor_id == actor_id)
    if since is not None:
        try:
            query = query.where(AuditEntry.at >= since.astimezone(UTC))
        except OverflowError as e:
            # e.g. 0001-01-01T00:00+01:00, which is before year 1 in UTC.
            raise BadRequest("since is out of range") from e
    return list_page(
        ctx, request, response, page, query, [AuditEntry.id], AuditEntryView.model_validate, descending=True
    )
