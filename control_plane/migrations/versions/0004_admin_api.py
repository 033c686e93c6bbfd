"""Admin API state: model specs, capacity, placement plans, tenants, audit log; deployments
gain placement and autoscaling specs and a resource version (ETag).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """One piece: a migration is a frozen, ordered list of schema statements applied in one
    transaction, read top to bottom against the revision it upgrades; split into helpers it
    would hide that order and invite edits to history."""
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("placement", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("autoscaling", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("resource_version", sa.Integer(), nullable=False, server_default="1"))
    op.create_table(
        "models",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("params_b", sa.Float(), nullable=False),
        sa.Column("layers", sa.Integer(), nullable=False),
        sa.Column("kv_heads", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("quantization", sa.String(16), nullable=False),
        sa.Column("kv_cache_dtype", sa.String(16), nullable=False),
        sa.Column("attention_heads", sa.Integer(), nullable=True),
        sa.Column("hidden_size", sa.Integer(), nullable=True),
        sa.Column("max_context", sa.Integer(), nullable=False),
        sa.Column("target_concurrent_seqs", sa.Integer(), nullable=False),
        sa.Column("weights_uri", sa.String(2048), nullable=True),
        sa.Column("resource_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_models")),
    )
    op.create_table(
        "capacity",
        sa.Column("region", sa.String(80), nullable=False),
        sa.Column("sku", sa.String(32), nullable=False),
        sa.Column("max_gpus", sa.Integer(), nullable=False),
        sa.Column("resource_version", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("max_gpus >= 0", name=op.f("ck_capacity_max_gpus_non_negative")),
        sa.PrimaryKeyConstraint("region", "sku", name=op.f("pk_capacity")),
    )
    op.create_table(
        "placement_plans",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("base_plan_id", sa.String(36), nullable=True),
        sa.Column("cost_per_hour", sa.Float(), nullable=True),
        sa.Column("assignments", sa.JSON(), nullable=False),
        sa.Column("diff", sa.JSON(), nullable=False),
        sa.Column("explanation", sa.Text(), nullable=True),
        sa.Column("solve_seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("applied_by", sa.String(200), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_placement_plans")),
    )
    op.create_index(op.f("ix_placement_plans_status"), "placement_plans", ["status"])
    op.create_index(op.f("ix_placement_plans_created_at"), "placement_plans", ["created_at"])
    op.create_index(
        "uq_placement_plans_one_applied",
        "placement_plans",
        ["status"],
        unique=True,
        sqlite_where=sa.text("status = 'applied'"),
        postgresql_where=sa.text("status = 'applied'"),
    )
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("zone", sa.String(32), nullable=False),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("resource_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tenants")),
    )
    # Keys created before tenants existed get a tenant of their own, in their key's zone
    # (the first key's zone where a tenant's keys disagree).
    op.execute(
        """
        INSERT INTO tenants (name, zone, models, resource_version, created_at, updated_at)
        SELECT k.tenant, k.zone, NULL, 1, k.created_at, k.created_at FROM api_keys k
        WHERE k.created_at = (SELECT MIN(k2.created_at) FROM api_keys k2 WHERE k2.tenant = k.tenant)
          AND k.id = (SELECT MIN(k3.id) FROM api_keys k3
                      WHERE k3.tenant = k.tenant AND k3.created_at = k.created_at)
        """
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor_id", sa.String(64), nullable=False),
        sa.Column("actor_name", sa.String(200), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("resource_type", sa.String(32), nullable=False),
        sa.Column("resource_id", sa.String(256), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"])
    op.create_index(op.f("ix_audit_log_resource_type"), "audit_log", ["resource_type"])
    op.create_index(op.f("ix_audit_log_resource_id"), "audit_log", ["resource_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_log_resource_id"), table_name="audit_log")
    op.drop_index(op.f("ix_audit_log_resource_type"), table_name="audit_log")
    op.drop_index(op.f("ix_audit_log_at"), table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_table("tenants")
    op.drop_index("uq_placement_plans_one_applied", table_name="placement_plans")
    op.drop_index(op.f("ix_placement_plans_created_at"), table_name="placement_plans")
    op.drop_index(op.f("ix_placement_plans_status"), table_name="placement_plans")
    op.drop_table("placement_plans")
    op.drop_table("capacity")
    op.drop_table("models")
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("resource_version")
        batch.drop_column("autoscaling")
        batch.drop_column("placement")
