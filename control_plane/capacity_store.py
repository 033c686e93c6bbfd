"""GPU capacity at rest: explicit limits per (region, SKU), over the on-prem inventory's defaults.

A row is an operator's limit (a cloud quota, a site's share for Meridian). Where there is
none, an on-prem site's limit is what its inventory racks: hosts × GPUs per host. Cloud
regions without a row have no limit here (quotas bite at provisioning time).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import Capacity
from control_plane.errors import NotFound
from providers.catalog import Catalog


@dataclass(frozen=True, slots=True)
class EffectiveCapacity:
    """The limit placement works with for one (region, SKU), and where it comes from."""

    region: str
    sku: str
    max_gpus: int
    source: Literal["explicit", "inventory"]
    resource_version: int | None = None  # explicit rows only: their ETag
    updated_at: datetime | None = None

    @classmethod
    def of(cls, row: Capacity) -> EffectiveCapacity:
        return cls(row.region, row.sku, row.max_gpus, "explicit", row.resource_version, row.updated_at)


def as_dict(row: Capacity) -> dict[str, Any]:
    """The row as the audit log records it."""
    return {
        "region": row.region,
        "sku": row.sku,
        "max_gpus": row.max_gpus,
        "resource_version": row.resource_version,
        "updated_at": row.updated_at.isoformat(),
    }


def inventory_defaults(catalog: Catalog) -> dict[tuple[str, str], int]:
    """GPUs per (region, SKU) of every finite (on-prem) site, from the catalog's host counts."""
    limited = {(o.region, o.sku) for o in catalog.offerings if (o.region, o.instance_type) in catalog.host_limits}
    out: dict[tuple[str, str], int] = {}
    for region, sku in limited:
        gpus = catalog.gpu_capacity(region, sku)
        if gpus is not None:
            out[(region, sku)] = gpus
    return out


def effective(session: Session, catalog: Catalog) -> list[EffectiveCapacity]:
    """Every explicit limit, plus the inventory default of each (region, SKU) without one (unsorted)."""
    explicit = {(r.region, r.sku): EffectiveCapacity.of(r) for r in session.scalars(select(Capacity))}
    defaults = [
        EffectiveCapacity(region, sku, gpus, "inventory")
        for (region, sku), gpus in inventory_defaults(catalog).items()
        if (region, sku) not in explicit
    ]
    return [*explicit.values(), *defaults]


def find(session: Session, region: str, sku: str, *, for_update: bool = False) -> Capacity | None:
    query = select(Capacity).where(Capacity.region == region, Capacity.sku == sku)
    if for_update:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def effective_one(session: Session, catalog: Catalog, region: str, sku: str) -> EffectiveCapacity:
    """The limit of one (region, SKU); NotFound when neither a row nor the inventory sets one."""
    row = find(session, region, sku)
    if row is not None:
        return EffectiveCapacity.of(row)
    gpus = inventory_defaults(catalog).get((region, sku))
    if gpus is None:
        raise NotFound(f"no capacity limit for {sku} in {region}")
    return EffectiveCapacity(region, sku, gpus, "inventory")


@dataclass(frozen=True, slots=True)
class Saved:
    """The outcome of a PUT: the row, and whether it was created or changed."""

    row: Capacity
    created: bool
    changed: bool


def put(session: Session, region: str, sku: str, max_gpus: int, now: datetime, row: Capacity | None) -> Saved:
    """Set the limit (`row`: the current one, already locked, or None); the same value is no change."""
    if row is None:
        row = Capacity(region=region, sku=sku, max_gpus=max_gpus, resource_version=1, updated_at=now)
        session.add(row)
        session.flush()
        return Saved(row, created=True, changed=True)
    if row.max_gpus == max_gpus:
        return Saved(row, created=False, changed=False)
    row.max_gpus = max_gpus
    row.resource_version += 1
    row.updated_at = now
    session.flush()
    return Saved(row, created=False, changed=True)


def get(session: Session, region: str, sku: str, *, for_update: bool = False) -> Capacity:
    """The explicit limit; NotFound when there is none."""
    row = find(session, region, sku, for_update=for_update)
    if row is None:
        raise NotFound(f"no explicit capacity limit for {sku} in {region}")
    return row


def delete(session: Session, row: Capacity) -> None:
    """Remove an explicit limit: the inventory default (or no limit) applies again."""
    session.delete(row)
    session.flush()
