"""Tenants get flow control's priority band and weight (`tenants.priority`, `tenants.weight`),
and a key may override its tenant's band (`api_keys.priority`).

Routers' flow control (issue 37) holds requests at the router once a zone's replicas of a
model are full and dispatches them by priority band first (larger is more urgent; a band
below 0 is sheddable, shed first when queues are full), then by each tenant's weighted share
of the work within its band. The routing table carries both per key (TenantEntry), a key's
own priority winning over its tenant's. Existing tenants get the defaults (band 0, weight 1:
everyone equal, nothing sheddable, as before); NULL on a key is its tenant's band. The
server defaults stay so that a control plane of the previous version, writing neither
column during a rolling upgrade, still inserts tenants.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("priority")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
        batch.drop_column("priority")
