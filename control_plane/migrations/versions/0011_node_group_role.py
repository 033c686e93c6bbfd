"""Each node group's prefill/decode role: a disaggregated deployment's prefill and decode
nodes of one instance type in one region are two groups, so the role joins the group's
unique key. Groups made before are co-located.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node_groups") as batch:
        batch.add_column(sa.Column("role", sa.String(16), nullable=False, server_default="both"))
        batch.drop_constraint(op.f("uq_node_groups_group_key"), type_="unique")
        batch.create_unique_constraint(
            op.f("uq_node_groups_group_key"), ["model", "region", "instance_type", "spot", "role"]
        )


def downgrade() -> None:
    # Two groups that differ only in their role cannot be one row again: keep the co-located
    # one where there is one, else the decode pool's, and drop the rest (the reconciler
    # re-creates what the plan still places).
    op.execute(
        "DELETE FROM node_groups WHERE role <> 'both' AND EXISTS (SELECT 1 FROM node_groups AS o"
        " WHERE o.model = node_groups.model AND o.region = node_groups.region"
        " AND o.instance_type = node_groups.instance_type AND o.spot = node_groups.spot"
        " AND (o.role = 'both' OR (o.role = 'decode' AND node_groups.role = 'prefill')))"
    )
    with op.batch_alter_table("node_groups") as batch:
        batch.drop_constraint(op.f("uq_node_groups_group_key"), type_="unique")
        batch.create_unique_constraint(op.f("uq_node_groups_group_key"), ["model", "region", "instance_type", "spot"])
        batch.drop_column("role")
