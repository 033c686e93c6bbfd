"""Nodes say what their engine can do (`nodes.capabilities`), and routers decide from that
rather than from the engine's name.

The router shaped two kinds of request by `engine == "vllm"`: a migrated stream's
continuation asks for `include_stop_str_in_output`, and a Responses request served as chat
asks for `add_special_tokens`. A node now registers the capabilities these depend on
(meridian.contracts.NodeCapability); NULL is a node whose agent predates them, taken to have
what its engine kind had (ENGINE_CAPABILITIES), so nothing changes for it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("capabilities", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("capabilities")
