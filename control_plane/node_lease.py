"""A node's liveness as a lease apart from its status (as Kubernetes moved node heartbeats to
Lease objects): a heartbeat that changes nothing routers see only renews the lease.

The full heartbeat (control_plane.node_registry.heartbeat) row-locks the node through the
ORM, reads its drain, syncs its cached weights, flushes and reads the routing version: seven
round trips and ~4 ms of control-plane CPU, spent again every interval by every node although
almost every heartbeat repeats the last one. `renew` is the common case in one statement:

    UPDATE nodes SET load, last_heartbeat[, cold_start]
    WHERE node_id = :id AND report_digest = :digest
      AND status = (draining if a drain is recorded, else the reported status)
    RETURNING (the routing version)

It matches only when the routing-relevant report is what the row already holds: the same
status (as `node_registry._status` would set it: a node being drained stays draining), the
same models and the same cached weights (`report_digest`, stored by the full path). Anything
else, and a node the reaper marked lost (its status is then `lost`, never a reported one),
matches no row and takes the full path, which bumps the version at once, syncs weights, or
answers 404 so the node registers again. Load and cold start still reach the row at every
heartbeat: the autoscaler and the reconciler's drain read them from it.

Correct with several control-plane replicas and with the reaper of each: the statement is
one atomic row update; on Postgres a concurrent reaper's UPDATE of the same row waits for it
(or it for the reaper) and re-checks its WHERE against the committed row (READ COMMITTED),
so a node is never renewed after being marked lost, nor marked lost by a stale read. Like
the full path, it stamps the database's clock (control_plane.db.clock) and runs in
autocommit on Postgres: no BEGIN/COMMIT round trips around the one statement.

Renewals run on a bulkhead of their own (AppContext.lease_engine, lease_threads): on Postgres
every write that bumps the routing version queues on that version's row lock, and a storm of
them (a fleet registering at once) held every connection of the shared pool; heartbeats
queued behind them went silent and were reaped (the fleet simulator's 10,000-node point).

Why not leases kept in memory and flushed in batches: measured, this statement costs ~0.5-0.7
ms of the ~2 ms a heartbeat costs end to end; the rest is HTTP, FastAPI and the thread hop,
which batching does not touch. Batching would save at most a third, and would cost every
replica's reaper a flush lag in its TTL, the reconciler and autoscaler stale load, and a
lost node its 404 one flush later.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import cache
from typing import Any

from sqlalchemy import Connection, Engine, Update, bindparam, case, func, select, update

from control_plane.db.models import Node, NodeDrain, RoutingState
from meridian.contracts import NodeHeartbeat, NodeStatus


def report_digest(models: list[str], weights: list[str] | None) -> str:
    """What a heartbeat says of the node's models and cached weights, as one comparable value
    (the weights as a set; None, "this node reports no weights", differs from an empty set)."""
    canonical = json.dumps([list(models), sorted(set(weights)) if weights is not None else None])
    return hashlib.sha256(canonical.encode()).hexdigest()


def renew(engine: Engine, node_id: str, hb: NodeHeartbeat) -> int | None:
    """Renew the lease of a node whose report is unchanged; returns the routing version, or
    None when the heartbeat must take the full path (a change, an unknown or a lost node)."""
    if not hb.models or hb.status == NodeStatus.LOST:
        # No models means "unchanged" to the full path, which reads them from the row.
        return None
    postgres = engine.dialect.name == "postgresql"
    # b_: an update's bind parameters may not be named as its columns.
    params: dict[str, Any] = {
        "b_node_id": node_id,
        "b_digest": report_digest(hb.models, hb.weights),
        "b_reported": hb.status.value,
        "b_load": hb.load.model_dump(),
    }
    if not postgres:
        # SQLite serves one replica in this process: the host's clock is the only one (db_now).
        params["b_now"] = datetime.now(UTC)
    if hb.cold_start is not None:
        params["b_cold_start"] = hb.cold_start.model_dump()
    with _one_statement(engine) as conn:
        version = conn.execute(_renew_statement(postgres, hb.cold_start is not None), params).scalar_one_or_none()
    return None if version is None else int(version)


@cache
def _renew_statement(postgres: bool, cold_start: bool) -> Update:
    """The renewal, built once per shape (building and keying a statement per heartbeat cost
    as much CPU as running it)."""
    node_id = bindparam("b_node_id")
    drained = select(NodeDrain.node_id).where(NodeDrain.node_id == node_id).exists()
    # The status the full path would record, in SQL: draining while a drain is recorded.
    effective_status = case((drained, NodeStatus.DRAINING.value), else_=bindparam("b_reported"))
    values: dict[str, Any] = {
        "load": bindparam("b_load", type_=Node.load.type),
        # The database's clock, as control_plane.db.clock.db_now reads it, without its round trip.
        "last_heartbeat": func.clock_timestamp() if postgres else bindparam("b_now", type_=Node.last_heartbeat.type),
    }
    if cold_start:
        values["cold_start"] = bindparam("b_cold_start", type_=Node.cold_start.type)
    return (
        update(Node)
        .where(Node.node_id == node_id, Node.report_digest == bindparam("b_digest"), Node.status == effective_status)
        .values(**values)
        .returning(select(RoutingState.version).where(RoutingState.id == 1).scalar_subquery())
    )


@contextmanager
def _one_statement(engine: Engine) -> Iterator[Connection]:
    """A connection for one atomic statement: autocommit on Postgres (no BEGIN/COMMIT round
    trips); on SQLite a transaction whose first statement takes the write lock."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")
    else:
        with engine.begin() as conn:
            yield conn
