"""Routers report the requests their flow control holds (`router_backlogs`).

Flow control (issue 37) keeps the nodes' queues short and holds the backlog at the routers,
so the nodes' heartbeats (running + waiting), which the autoscaler scaled on, stopped showing
it: a saturated deployment looked exactly full and never grew. Each router now reports what
it holds per (zone, model) pool; a report replaces the router's rows, and a row past the
backlog TTL (a router that stopped reporting) counts for nothing.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "router_backlogs",
        sa.Column("router_id", sa.String(128), primary_key=True),
        sa.Column("zone", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_router_backlogs_reported_at", "router_backlogs", ["reported_at"])


def downgrade() -> None:
    op.drop_index("ix_router_backlogs_reported_at", table_name="router_backlogs")
    op.drop_table("router_backlogs")
