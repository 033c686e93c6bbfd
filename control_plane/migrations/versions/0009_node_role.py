"""Each node's prefill/decode role and KV transfer, which routers need to pair a prefill
worker with a decode worker of the same zone. Nodes registered before are co-located.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("role", sa.String(16), nullable=False, server_default="both"))
        batch.add_column(sa.Column("kv_transfer", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("kv_transfer")
        batch.drop_column("role")
