"""The audit log: every change, who made it, and the resource before and after.

Entries are written in the transaction of the change they describe, so a change that
rolls back leaves no entry and no committed change goes unrecorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from control_plane.db.models import AuditEntry


@dataclass(frozen=True, slots=True)
class Actor:
    """Who makes a change: an API key (id and name) or one of the control plane's loops."""

    id: str
    name: str
    request_id: str | None = None

    @classmethod
    def system(cls, component: str) -> Actor:
        return cls(id=f"system:{component}", name=component)


def record(
    session: Session,
    actor: Actor,
    *,
    action: str,
    resource_type: str,
    resource_id: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    now: datetime,
) -> AuditEntry:
    """Add one entry to the caller's transaction."""
    entry = AuditEntry(
        at=now,
        actor_id=actor.id[:64],
        actor_name=actor.name[:200],
        action=action,
        resource_type=resource_type,
        resource_id=resource_id[:256],
        before=before,
        after=after,
        request_id=actor.request_id,
    )
    session.add(entry)
    return entry
