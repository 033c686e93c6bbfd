"""Weight replicas (which node holds or fetches which model) and each node's cold start.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "weight_replicas",
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("node_id", sa.String(63), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.node_id"], name=op.f("fk_weight_replicas_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("digest", "node_id", name=op.f("pk_weight_replicas")),
    )
    op.create_index(op.f("ix_weight_replicas_node_id"), "weight_replicas", ["node_id"])
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("cold_start", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("cold_start")
    op.drop_index(op.f("ix_weight_replicas_node_id"), table_name="weight_replicas")
    op.drop_table("weight_replicas")
