"""A deployment's prefill/decode topology (pools per region, connector, mix) and the
prefill pool's desired count. Deployments created before are co-located.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("disaggregation", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("desired_prefill_replicas", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("desired_prefill_replicas")
        batch.drop_column("disaggregation")
