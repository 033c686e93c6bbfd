"""Nodes say how many sequences their engine runs at once (`nodes.max_num_seqs`).

Routers' flow control (issue 37) holds requests at the router once a zone's replicas of a
model are full, so that the backlog waits where it can be ordered by priority and fairness
rather than in each node's first-come queue. "Full" is the node's batch: vLLM's
--max-num-seqs, the torch engine's max_num_seqs. A node now registers it; NULL is a node
whose agent predates it, for which routers use their configured default.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("max_num_seqs", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("max_num_seqs")
