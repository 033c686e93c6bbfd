"""A tenant's residency zone is stored once, on the tenant: `api_keys.zone` goes.

Every key carried a copy of its tenant's zone, kept in step by one UPDATE when the zone
changed; the routing table read the key's copy. Two copies of the one fact that decides
where a tenant's data may go can disagree, and then a key's requests go where its tenant's
may not. Now the routing table and the admin API take a key's zone from its tenant
(meridian.residency owns the rule; control_plane.db.models.ApiKey.zone reads it).

Nothing is lost on the way:
- a tenant that has keys but no row (keys older than tenants made one in 0004; since then a
  key needs its tenant, save the bootstrap admin key's) gets one in its keys' zone, unless its
  keys are all global and none serves inference (the bootstrap operator's: nothing of theirs
  depends on a zone, and listings of tenants do not show it);
- where a live key's zone differs from its tenant's, or a tenant without a row has keys in
  several zones, the upgrade stops and names them, changing nothing: which zone is right is
  the operator's call (revoke the stray keys, or set the tenant's zone), never a guess.

Downgrade puts the column back, each key in its tenant's zone (global without a tenant row).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """One piece (as 0004): check, backfill the missing tenants, drop the copy."""
    conn = op.get_bind()
    stray = conn.execute(sa.text(
        "SELECT k.id, k.tenant, k.zone, t.zone FROM api_keys k JOIN tenants t ON t.name = k.tenant"
        " WHERE k.zone <> t.zone AND k.revoked_at IS NULL ORDER BY k.tenant, k.id"
    )).all()
    if stray:
        listed = "; ".join(f"key {i} of {tenant} is in {zone}, its tenant in {own}" for i, tenant, zone, own in stray)
        raise RuntimeError(f"keys whose zone is not their tenant's (revoke them or set the tenant's zone): {listed}")
    orphans: dict[str, list[tuple[str, object, object]]] = {}
    for tenant, zone, scopes, created_at in conn.execute(sa.text(
        "SELECT k.tenant, k.zone, k.scopes, k.created_at FROM api_keys k"
        " WHERE NOT EXISTS (SELECT 1 FROM tenants t WHERE t.name = k.tenant) ORDER BY k.created_at, k.id"
    )):
        orphans.setdefault(tenant, []).append((zone, scopes, created_at))
    for tenant, keys in orphans.items():
        zones = sorted({zone for zone, _, _ in keys})
        if len(zones) > 1:
            raise RuntimeError(f"tenant {tenant} has no row and keys in zones {', '.join(zones)}: create it in one")
        serves = any("inference" in (json.loads(s) if isinstance(s, str) else s or []) for _, s, _ in keys)
        if zones == ["global"] and not serves:
            continue
        conn.execute(sa.text(
            "INSERT INTO tenants (name, zone, models, resource_version, created_at, updated_at)"
            " VALUES (:name, :zone, NULL, 1, :at, :at)"
        ), {"name": tenant, "zone": zones[0], "at": keys[0][2]})
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("zone")


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("zone", sa.String(32), nullable=False, server_default="global"))
    op.execute(
        "UPDATE api_keys SET zone = (SELECT t.zone FROM tenants t WHERE t.name = api_keys.tenant)"
        " WHERE EXISTS (SELECT 1 FROM tenants t WHERE t.name = api_keys.tenant)"
    )
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column("zone", server_default=None)
