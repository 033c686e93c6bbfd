"""Initial schema: nodes, api_keys, routing_state.

Revision ID: 0001
Revises:
Create Date: 2025-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(63), nullable=False),
        sa.Column("region", sa.String(80), nullable=False),
        sa.Column("provider", sa.String(16), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("engine", sa.String(16), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("load", sa.JSON(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_nodes")),
    )
    op.create_index(op.f("ix_nodes_region"), "nodes", ["region"])
    op.create_index(op.f("ix_nodes_status"), "nodes", ["status"])
    op.create_index(op.f("ix_nodes_last_heartbeat"), "nodes", ["last_heartbeat"])

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("zone", sa.String(32), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    op.create_index(op.f("ix_api_keys_key_hash"), "api_keys", ["key_hash"], unique=True)
    op.create_index(op.f("ix_api_keys_tenant"), "api_keys", ["tenant"])

    routing_state = op.create_table(
        "routing_state",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_routing_state_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_routing_state")),
    )
    op.bulk_insert(routing_state, [{"id": 1, "version": 0}])


def downgrade() -> None:
    op.drop_table("routing_state")
    op.drop_index(op.f("ix_api_keys_tenant"), table_name="api_keys")
    op.drop_index(op.f("ix_api_keys_key_hash"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_index(op.f("ix_nodes_last_heartbeat"), table_name="nodes")
    op.drop_index(op.f("ix_nodes_status"), table_name="nodes")
    op.drop_index(op.f("ix_nodes_region"), table_name="nodes")
    op.drop_table("nodes")
