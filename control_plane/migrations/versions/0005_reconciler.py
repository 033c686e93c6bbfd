"""Reconciler and autoscaler state: leadership (fencing epoch), node groups, node drains,
reconcile steps and autoscaler decisions.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """One piece: a migration is a frozen, ordered list of schema statements applied in one
    transaction, read top to bottom against the revision it upgrades; split into helpers it
    would hide that order and invite edits to history."""
    op.create_table(
        "leadership",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leadership")),
    )
    op.create_table(
        "node_groups",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("provider", sa.String(16), nullable=False),
        sa.Column("region", sa.String(80), nullable=False),
        sa.Column("instance_type", sa.String(64), nullable=False),
        sa.Column("sku", sa.String(32), nullable=False),
        sa.Column("spot", sa.Boolean(), nullable=False),
        sa.Column("gpus_per_node", sa.Integer(), nullable=False),
        sa.Column("desired_size", sa.Integer(), nullable=False),
        sa.Column("current_size", sa.Integer(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.String(1000), nullable=True),
        sa.Column("resource_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "desired_size >= 0 AND current_size >= 0", name=op.f("ck_node_groups_sizes_non_negative")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_groups")),
        sa.UniqueConstraint(
            "model", "region", "instance_type", "spot", name=op.f("uq_node_groups_group_key")
        ),
    )
    op.create_index(op.f("ix_node_groups_model"), "node_groups", ["model"])
    op.create_table(
        "node_drains",
        sa.Column("node_id", sa.String(63), nullable=False),
        sa.Column("node_group_id", sa.String(36), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_node_drains")),
    )
    op.create_index(op.f("ix_node_drains_node_group_id"), "node_drains", ["node_group_id"])
    op.create_table(
        "reconcile_steps",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("node_group_id", sa.String(36), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("target", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("detail", sa.String(1000), nullable=True),
        sa.Column("error", sa.String(1000), nullable=True),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconcile_steps")),
    )
    op.create_index(op.f("ix_reconcile_steps_at"), "reconcile_steps", ["at"])
    op.create_index(op.f("ix_reconcile_steps_node_group_id"), "reconcile_steps", ["node_group_id"])
    op.create_index(op.f("ix_reconcile_steps_model"), "reconcile_steps", ["model"])
    op.create_table(
        "autoscaler_decisions",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("current", sa.Integer(), nullable=False),
        sa.Column("desired", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autoscaler_decisions")),
    )
    op.create_index(op.f("ix_autoscaler_decisions_model"), "autoscaler_decisions", ["model"])
    op.create_index(op.f("ix_autoscaler_decisions_at"), "autoscaler_decisions", ["at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_autoscaler_decisions_at"), table_name="autoscaler_decisions")
    op.drop_index(op.f("ix_autoscaler_decisions_model"), table_name="autoscaler_decisions")
    op.drop_table("autoscaler_decisions")
    op.drop_index(op.f("ix_reconcile_steps_model"), table_name="reconcile_steps")
    op.drop_index(op.f("ix_reconcile_steps_node_group_id"), table_name="reconcile_steps")
    op.drop_index(op.f("ix_reconcile_steps_at"), table_name="reconcile_steps")
    op.drop_table("reconcile_steps")
    op.drop_index(op.f("ix_node_drains_node_group_id"), table_name="node_drains")
    op.drop_table("node_drains")
    op.drop_index(op.f("ix_node_groups_model"), table_name="node_groups")
    op.drop_table("node_groups")
    op.drop_table("leadership")
