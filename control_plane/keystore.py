"""API keys at rest: creation, lookup by hash, revocation and the bootstrap admin key."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import ApiKey
from control_plane.errors import NotFound
from control_plane.routing_table import bump_version
from control_plane.scopes import Scope
from meridian.security import generate_api_key, hash_api_key, key_prefix

BOOTSTRAP_KEY_NAME = "bootstrap-admin"
BOOTSTRAP_TENANT = "meridian"


def _in_routing_table(key: ApiKey) -> bool:
    return Scope.INFERENCE.value in key.scopes


def create_key(
    session: Session,
    *,
    name: str,
    tenant: str,
    scopes: Sequence[Scope],
    models: Sequence[str] | None,
    now: datetime,
    plaintext: str | None = None,
    priority: int | None = None,
) -> tuple[ApiKey, str]:
    """Store a key's hash (of `plaintext`, or of a newly generated key when None); returns the
    row and the plaintext, which is never stored. Its zone is its tenant's."""
    if plaintext is None:
        plaintext = generate_api_key()
    row = ApiKey(
        id=str(uuid.uuid4()),
        name=name,
        tenant=tenant,
        scopes=sorted({s.value for s in scopes}),
        models=list(models) if models is not None else None,
        priority=priority,
        key_hash=hash_api_key(plaintext),
        key_prefix=key_prefix(plaintext),
        created_at=now,
        revoked_at=None,
    )
    session.add(row)
    session.flush()
    if _in_routing_table(row):
        bump_version(session)
    return row, plaintext


def find_active_key(session: Session, plaintext: str) -> ApiKey | None:
    """The unrevoked key whose hash matches, if any."""
    return session.scalars(
        select(ApiKey).where(ApiKey.key_hash == hash_api_key(plaintext), ApiKey.revoked_at.is_(None))
    ).one_or_none()


def get_key(session: Session, key_id: str, *, for_update: bool = False) -> ApiKey:
    """The key with this id (revoked or not); NotFound when there is none."""
    row = session.get(ApiKey, key_id, with_for_update=for_update)
    if row is None:
        raise NotFound(f"no API key with id {key_id!r}")
    return row


def revoke_key(session: Session, key_id: str, now: datetime) -> bool:
    """Revoke a key (idempotent: False when it already was); NotFound when no key has this id."""
    row = get_key(session, key_id, for_update=True)
    if row.revoked_at is not None:
        return False
    row.revoked_at = now
    if _in_routing_table(row):
        bump_version(session)
    return True


def ensure_bootstrap_key(session: Session, plaintext: str, now: datetime) -> bool:
    """Make sure the configured bootstrap key exists as an admin key; True if it was added.

    A bootstrap key that an admin revoked stays revoked: start-up must not undo that.
    """
    existing = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_api_key(plaintext))).one_or_none()
    if existing is not None:
        return False
    create_key(
        session,
        plaintext=plaintext,
        name=BOOTSTRAP_KEY_NAME,
        tenant=BOOTSTRAP_TENANT,
        scopes=[Scope.ADMIN],
        models=None,
        now=now,
    )
    return True
