"""Model specs at rest: the architecture model fit sizes replicas from, one row per model name."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import Deployment, ModelRecord
from control_plane.errors import Conflict, NotFound
from control_plane.placement.fit import ModelSpec

# The fields a client sets; the rest (version, timestamps) are the store's.
SPEC_FIELDS = (
    "params_b",
    "layers",
    "kv_heads",
    "head_dim",
    "quantization",
    "kv_cache_dtype",
    "attention_heads",
    "hidden_size",
    "max_context",
    "target_concurrent_seqs",
    "weights_uri",
)


@dataclass(frozen=True, slots=True)
class Saved:
    """The outcome of a PUT: the row, and whether it was created or changed."""

    row: ModelRecord
    created: bool
    changed: bool


def as_dict(row: ModelRecord) -> dict[str, Any]:
    """The model as the API shows it and the audit log records it."""
    return {
        "name": row.name,
        **{f: getattr(row, f) for f in SPEC_FIELDS},
        "resource_version": row.resource_version,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }


def find(session: Session, name: str, *, for_update: bool = False) -> ModelRecord | None:
    query = select(ModelRecord).where(ModelRecord.name == name)
    if for_update:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def get(session: Session, name: str, *, for_update: bool = False) -> ModelRecord:
    """The model called `name`; NotFound when there is none."""
    row = find(session, name, for_update=for_update)
    if row is None:
        raise NotFound(f"no model {name!r}")
    return row


def put(session: Session, name: str, spec: dict[str, Any], now: datetime, row: ModelRecord | None) -> Saved:
    """Create the model or replace its spec (`row`: the current one, already locked, or None).

    Replacing with an identical spec is no change: the version (ETag) stays.
    """
    if row is None:
        row = ModelRecord(name=name, resource_version=1, created_at=now, updated_at=now, **spec)
        session.add(row)
        session.flush()
        return Saved(row=row, created=True, changed=True)
    if all(getattr(row, f) == spec[f] for f in SPEC_FIELDS):
        return Saved(row=row, created=False, changed=False)
    for field in SPEC_FIELDS:
        setattr(row, field, spec[field])
    row.resource_version += 1
    row.updated_at = now
    session.flush()
    return Saved(row=row, created=False, changed=True)


def delete(session: Session, row: ModelRecord) -> None:
    """Remove a model; Conflict while a deployment serves it (placement could no longer size it)."""
    deployed = session.scalars(select(Deployment.model).where(Deployment.model == row.name)).first()
    if deployed is not None:
        raise Conflict(f"model {row.name!r} has a deployment; delete the deployment first")
    session.delete(row)
    session.flush()


def spec_of(row: ModelRecord) -> ModelSpec:
    """The row as model fit takes it."""
    # The table has a column for every field of ModelSpec, under the same name.
    return ModelSpec(**{f.name: getattr(row, f.name) for f in fields(ModelSpec)})
