"""A heartbeat's lease renewal as a HOT update and a primary-key lookup whatever the fleet's
size: no index on `nodes.last_heartbeat` nor on `nodes.status`, and room in each page of
`nodes` for the row's next version (fillfactor 50, Postgres).

Postgres rewrites a row's index entries on an update unless no indexed column changed and the
new version fits in the same page (a heap-only tuple, HOT). With `last_heartbeat` indexed,
every renewal (control_plane.node_lease: one UPDATE of `load` and `last_heartbeat`) inserted
an entry into all four of the table's indexes and left the old ones for vacuum: 0 of 59,528
renewals were HOT in a 10,000-node run of the fleet simulator. With this migration all are;
a HOT version's predecessors are pruned in place by the next reader of the page, without
vacuum. The reaper reads the whole (small) table per pass anyway (its per-region aggregate is
a scan), so the index saved it nothing.

`nodes.status`: the renewal's statement is prepared by psycopg after a few executions, and
Postgres fixes its generic plan then, for the connection's life. Planned while the table
held a few rows (a fleet starting, statistics not yet gathered), that plan read the node by
`ix_nodes_status` and filtered on its id: at 10,000 nodes, where nearly every row is ready,
each renewal walked 10,020 rows (6.8 ms, against 0.03 ms by the primary key), and the 10,000-
node simulator's Postgres spent 0.8-0.96 of a core on ~240 renewals a second. Nothing reads
the fleet by status selectively (nearly every node is ready; the readers count or scan it
whole), so the index goes rather than the plan being forced.

`python -m bench.lease_writes --nodes 10000 --seconds 20 --rounds 1` (a fleet of 10,000
joining behind 20 nodes that already heartbeat, 4 threads): Postgres 0.29 ms of CPU per
renewal against 1.69 before, 2.2 times the renewals in the same time, all of them HOT.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Half of each page free for the next versions of its rows: a node row is ~300-600 bytes, so
# a page keeps 6-12 rows and room for as many renewals before pruning has to make space.
FILLFACTOR = 50


def upgrade() -> None:
    op.drop_index("ix_nodes_last_heartbeat", table_name="nodes")
    op.drop_index("ix_nodes_status", table_name="nodes")
    if op.get_bind().dialect.name == "postgresql":
        # New pages only; existing ones get the room as their rows move on update.
        op.execute(f"ALTER TABLE nodes SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE nodes RESET (fillfactor)")
    op.create_index("ix_nodes_status", "nodes", ["status"])
    op.create_index("ix_nodes_last_heartbeat", "nodes", ["last_heartbeat"])
