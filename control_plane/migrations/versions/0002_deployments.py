"""Deployments: a model, its residency zone and its replica bounds (scale-from-zero).

Revision ID: 0002
Revises: 0001
Create Date: 2025-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployments",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("zone", sa.String(32), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("desired_replicas", sa.Integer(), nullable=False),
        sa.Column("last_scale_request_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_scale_reason", sa.String(200), nullable=True),
        sa.Column("last_scale_region", sa.String(80), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("min_replicas >= 0", name=op.f("ck_deployments_min_replicas_non_negative")),
        sa.CheckConstraint("max_replicas >= 1", name=op.f("ck_deployments_max_replicas_positive")),
        sa.CheckConstraint("min_replicas <= max_replicas", name=op.f("ck_deployments_min_le_max")),
        sa.CheckConstraint(
            "desired_replicas >= 0 AND desired_replicas <= max_replicas",
            name=op.f("ck_deployments_desired_in_range"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployments")),
    )
    op.create_index(op.f("ix_deployments_model"), "deployments", ["model"], unique=True)


def downgrade() -> None:
    op.drop_index(op.f("ix_deployments_model"), table_name="deployments")
    op.drop_table("deployments")
