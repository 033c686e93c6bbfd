"""Tenants at rest: a zone, allowed models, rate limits and flow control's priority and weight
that every key of the tenant carries (a key may override the priority)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane.db.models import ApiKey, Tenant
from control_plane.errors import Conflict, NotFound
from control_plane.routing_table import bump_version
from meridian.contracts import DEFAULT_PRIORITY, DEFAULT_TENANT_WEIGHT


def as_dict(row: Tenant) -> dict[str, Any]:
    """The tenant as the API shows it and the audit log records it."""
    return {
        "name": row.name,
        "zone": row.zone,
        "models": row.models,
        "requests_per_minute": row.requests_per_minute,
        "tokens_per_minute": row.tokens_per_minute,
        "cache_group": row.cache_group,
        "priority": row.priority,
        "weight": row.weight,
        "resource_version": row.resource_version,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }


def get(session: Session, name: str, *, for_update: bool = False) -> Tenant:
    """The tenant called `name`; NotFound when there is none."""
    query = select(Tenant).where(Tenant.name == name)
    if for_update:
        query = query.with_for_update()
    row = session.scalars(query).one_or_none()
    if row is None:
        raise NotFound(f"no tenant {name!r}")
    return row


def find(session: Session, name: str) -> Tenant | None:
    return session.get(Tenant, name)


def close_names(session: Session, name: str) -> list[str]:
    """The tenants named most like `name` (a mistyped name's likely meaning), closest first."""
    return difflib.get_close_matches(name, session.scalars(select(Tenant.name)).all(), n=1, cutoff=0.6)


def create(
    session: Session,
    name: str,
    *,
    zone: str,
    models: Sequence[str] | None,
    requests_per_minute: int | None,
    tokens_per_minute: int | None,
    now: datetime,
    cache_group: str | None = None,
    priority: int = DEFAULT_PRIORITY,
    weight: float = DEFAULT_TENANT_WEIGHT,
) -> Tenant:
    """Add a tenant; Conflict when the name is taken."""
    if session.get(Tenant, name) is not None:
        raise Conflict(f"tenant {name!r} already exists")
    row = Tenant(
        name=name,
        zone=zone,
        models=list(models) if models is not None else None,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        cache_group=cache_group,
        priority=priority,
        weight=weight,
        resource_version=1,
        created_at=now,
        updated_at=now,
    )
    session.add(row)
    session.flush()
    return row


def update_fields(session: Session, row: Tenant, changes: dict[str, Any], now: datetime) -> bool:
    """Apply changed fields (a new zone is its keys' at once: they read it from the tenant).
    True if anything changed."""
    changed = {k: v for k, v in changes.items() if getattr(row, k) != v}
    if not changed:
        return False
    for key, value in changed.items():
        setattr(row, key, value)
    row.resource_version += 1
    row.updated_at = now
    session.flush()
    bump_version(session)
    return True


def delete(session: Session, row: Tenant, now: datetime) -> int:
    """Remove the tenant and revoke its keys; returns how many keys were revoked."""
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.tenant == row.name, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    session.delete(row)
    session.flush()
    bump_version(session)
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
