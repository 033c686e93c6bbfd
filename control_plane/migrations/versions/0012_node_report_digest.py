"""A digest of what each node last reported of its models and cached weights, so that a
heartbeat that repeats it renews the node's lease in one statement instead of a locked read,
a weight sync and a flush (control_plane.node_lease). NULL: take the full path next time.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("report_digest", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("report_digest")
