"""A heartbeat that repeats the node's last report costs one statement and no routing version;
anything routers see still changes at once, and a lost node is still sent to register again.

The cost is what a fleet pays: one control plane takes every node's heartbeat every interval.
Statements are counted on the control plane's own engine (SQLAlchemy's cursor events), on
SQLite and on Postgres. The app runs on a ManualClock, so its heartbeat pacing never re-reads
the fleet's size in the middle of a count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from cp_harness import ControlPlane, on_manual_clock
from sqlalchemy import delete, event, text, update

from control_plane.app import create_app
from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node, NodeDrain, RoutingState
from control_plane.node_lease import _renew_statement, report_digest
from meridian.settings.control_plane import ControlPlaneSettings

WEIGHTS = ["a" * 64, "b" * 64]
LOAD = {"running": 1, "waiting": 0, "kv_cache_usage": 0.25}

pytestmark = on_manual_clock


@contextmanager
def statements(cp: ControlPlane) -> Iterator[list[str]]:
    """The SQL statements the control plane sends its database meanwhile, transaction control
    aside (SQLite's BEGIN runs in the process; psycopg's never passes these events)."""
    ctx: AppContext = cp.app.state.ctx
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, sql: str, *_args: Any) -> None:
        if not sql.lstrip().upper().startswith("BEGIN"):
            sent.append(sql)

    # Lease renewals have an engine of their own on Postgres (the bulkhead): both are heard.
    engines = {ctx.engine, ctx.leases}
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


async def _node(cp: ControlPlane, node_id: str) -> dict[str, Any]:
    r = await cp.http.get(f"/v1/nodes/{node_id}", headers=cp.admin)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_an_unchanged_heartbeat_is_one_statement_and_keeps_the_version(cp: ControlPlane) -> None:
    await cp.register("node-a", status="starting")
    first = await cp.heartbeat("node-a", models=["tiny-llama"], weights=WEIGHTS, load=LOAD)
    assert first.status_code == 200
    version = first.json()["routing_version"]
    before = (await _node(cp, "node-a"))["last_heartbeat"]

    with statements(cp) as sent:
        r = await cp.heartbeat("node-a", models=["tiny-llama"], weights=list(reversed(WEIGHTS)),
                               load={**LOAD, "running": 7}, cold_start={"ready_s": 3.5})
    assert r.status_code == 200
    assert r.json()["routing_version"] == version
    assert len(sent) == 1, sent
    assert sent[0].lstrip().upper().startswith("UPDATE")

    # What it renewed reached the database: the autoscaler and the reconciler read it there.
    node = await _node(cp, "node-a")
    assert node["load"]["running"] == 7
    assert node["cold_start"]["ready_s"] == 3.5
    assert node["last_heartbeat"] >= before
    assert node["weights"] == sorted(WEIGHTS)
    assert await cp.version() == version


async def test_a_change_routers_see_takes_the_full_path_and_bumps_at_once(cp: ControlPlane) -> None:
    await cp.register("node-a", status="starting")
    starting = {"status": "starting", "models": ["tiny-llama"], "weights": WEIGHTS}
    v = (await cp.heartbeat("node-a", **starting)).json()["routing_version"]
    assert (await cp.heartbeat("node-a", **starting)).json()["routing_version"] == v  # renewed only

    r = await cp.heartbeat("node-a", status="ready", models=["tiny-llama"], weights=WEIGHTS)
    assert r.json()["routing_version"] == v + 1
    assert (await cp.table()).json()["nodes"][0]["status"] == "ready"

    r = await cp.heartbeat("node-a", status="ready", models=["tiny-llama", "other"], weights=WEIGHTS)
    assert r.json()["routing_version"] == v + 2
    assert (await cp.table()).json()["nodes"][0]["models"] == ["tiny-llama", "other"]

    # A new cached set is synced (peers fetch from it) without a routing change.
    r = await cp.heartbeat("node-a", status="ready", models=["tiny-llama", "other"], weights=WEIGHTS[:1])
    assert r.json()["routing_version"] == v + 2
    assert (await _node(cp, "node-a"))["weights"] == WEIGHTS[:1]


async def test_a_lost_nodes_heartbeat_is_404_and_it_registers_again(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready")
    await cp.heartbeat("node-a", status="ready", models=["tiny-llama"])
    # As the reaper marks it (of this or another replica).
    ctx: AppContext = cp.app.state.ctx
    with ctx.write() as session:
        session.execute(update(Node).where(Node.node_id == "node-a").values(status="lost"))

    cp.assert_problem(await cp.heartbeat("node-a", status="ready", models=["tiny-llama"]), 404)
    assert (await cp.table()).json()["nodes"] == []

    assert (await cp.register("node-a", status="ready")).status_code == 200
    r = await cp.heartbeat("node-a", status="ready", models=["tiny-llama"])
    assert r.status_code == 200
    assert [n["node_id"] for n in (await cp.table()).json()["nodes"]] == ["node-a"]


async def test_a_draining_node_stays_draining_until_the_drain_is_lifted(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready")
    await cp.heartbeat("node-a", status="ready", models=["tiny-llama"])
    ctx: AppContext = cp.app.state.ctx
    with ctx.write() as session:  # as the reconciler drains a node it removes
        session.add(NodeDrain(node_id="node-a", node_group_id="g", requested_at=db_now(session)))
        session.execute(update(Node).where(Node.node_id == "node-a").values(status="draining"))
    v = await cp.version()

    for _ in range(2):
        r = await cp.heartbeat("node-a", status="ready", models=["tiny-llama"])
        assert r.json()["routing_version"] == v
    assert (await cp.table()).json()["nodes"][0]["status"] == "draining"

    with ctx.write() as session:
        session.execute(delete(NodeDrain).where(NodeDrain.node_id == "node-a"))
    r = await cp.heartbeat("node-a", status="ready", models=["tiny-llama"])
    assert r.json()["routing_version"] == v + 1
    assert (await cp.table()).json()["nodes"][0]["status"] == "ready"


async def test_a_report_after_a_withdrawal_is_synced_again(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready")
    await cp.heartbeat("node-a", status="ready", models=["tiny-llama"], weights=WEIGHTS)
    r = await cp.http.delete(f"/v1/weights/{WEIGHTS[0]}/nodes/node-a", headers=cp.internal)
    assert r.status_code == 204
    assert (await _node(cp, "node-a"))["weights"] == WEIGHTS[1:]
    # The node's next report, built before it withdrew, still lists it: the report wins, as before.
    await cp.heartbeat("node-a", status="ready", models=["tiny-llama"], weights=WEIGHTS)
    assert (await _node(cp, "node-a"))["weights"] == WEIGHTS


async def test_replicas_on_one_database_see_each_others_reports(cp: ControlPlane, settings: ControlPlaneSettings) -> None:
    """Heartbeats of one node reach two control planes in turn (behind one address): what the
    lease path compares is in the database, so neither renews a report the other replaced."""
    other = create_app(settings)
    async with other.router.lifespan_context(other):
        transport = httpx.ASGITransport(app=other)
        async with httpx.AsyncClient(transport=transport, base_url="http://other.test") as http:

            async def beat_other(**fields: Any) -> httpx.Response:
                body = {"status": "ready", "models": ["tiny-llama"], **fields}
                return await http.post("/v1/nodes/node-a/heartbeat", json=body, headers=cp.internal)

            await cp.register("node-a", status="ready")
            await cp.heartbeat("node-a", models=["tiny-llama"], weights=WEIGHTS)
            assert (await beat_other(weights=WEIGHTS[:1])).status_code == 200
            assert (await _node(cp, "node-a"))["weights"] == WEIGHTS[:1]
            # The report this replica saw last, sent again: the database holds the other's.
            await cp.heartbeat("node-a", models=["tiny-llama"], weights=WEIGHTS)
            assert (await _node(cp, "node-a"))["weights"] == WEIGHTS

            v = await cp.version()
            r = await beat_other(status="draining", weights=WEIGHTS)
            assert r.json()["routing_version"] == v + 1
            r = await cp.heartbeat("node-a", status="ready", models=["tiny-llama"], weights=WEIGHTS)
            assert r.json()["routing_version"] == v + 2
            assert (await cp.table()).json()["nodes"][0]["status"] == "ready"


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_a_registration_storm_commits_past_a_held_routing_version(cp: ControlPlane) -> None:
    """Node writes no longer queue on the routing version's row lock (control_plane.
    version_bumper): while another writer holds that row, a storm of registrations larger
    than the connection pool commits its rows and gives the connections back, only the one
    bump that will cover them all waits on the lock, and a heartbeat that changes nothing is
    answered meanwhile. Each registration is answered once the version moves past it.
    (Postgres only: SQLite has one writer at a time, whatever the pool.)"""
    await cp.register("node-a", status="ready")
    assert (await cp.heartbeat("node-a", models=["tiny-llama"], weights=WEIGHTS, load=LOAD)).status_code == 200
    ctx: AppContext = cp.app.state.ctx
    pool = ctx.engine.pool.size() + ctx.engine.pool._max_overflow  # type: ignore[attr-defined]
    storm = pool + 5
    ctx.registrations.limit = None  # admission off (registration_gate): the storm is the point here
    with ctx.engine.connect() as holder:
        holder.execute(update(RoutingState).where(RoutingState.id == 1).values(version=RoutingState.version + 1))
        registrations = [asyncio.create_task(cp.register(f"storm-{i:02d}", status="ready")) for i in range(storm)]
        await _until_db(ctx, "SELECT count(*) FROM nodes WHERE node_id LIKE 'storm-%'", storm)
        await _until_db(ctx, _WAITING_ON_LOCKS, 1)
        assert _db(ctx, _WAITING_ON_LOCKS) == 1  # the bump, not one transaction per registration

        r = await asyncio.wait_for(
            cp.heartbeat("node-a", models=["tiny-llama"], weights=WEIGHTS, load={**LOAD, "running": 3}), 10.0
        )
        assert r.status_code == 200
        assert not any(t.done() for t in registrations)  # each waits for the bump that covers it
        holder.rollback()
    assert all(r.status_code == 200 for r in await asyncio.gather(*registrations))
    assert (await _node(cp, "node-a"))["load"]["running"] == 3
    assert {n["node_id"] for n in (await cp.table()).json()["nodes"]} >= {f"storm-{i:02d}" for i in range(storm)}


_WAITING_ON_LOCKS = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                     "AND wait_event_type = 'Lock'")


def _db(ctx: AppContext, query: str) -> int:
    with ctx.leases.connect() as conn:
        return int(conn.execute(text(query)).scalar_one())


async def _until_db(ctx: AppContext, query: str, at_least: int) -> None:
    """Until `query` counts that many (real time: the waits are the database's)."""
    deadline = asyncio.get_running_loop().time() + 20.0
    while (seen := _db(ctx, query)) < at_least:
        assert asyncio.get_running_loop().time() < deadline, f"only {seen} of {at_least}: {query}"
        await asyncio.sleep(0.05)


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_a_renewal_rewrites_no_index_entry(cp: ControlPlane) -> None:
    """A renewal is a HOT update on Postgres (migration 0013): the row's new version stays in
    its page and no index gets an entry for it, so a fleet's heartbeats leave no index churn
    for vacuum. Counted by Postgres itself for one transaction of renewals, one per node (the
    renewal's own statement, as the fast path runs it). Before 0013: 0 of 5 were HOT."""
    nodes = [f"node-{i}" for i in range(5)]
    for node_id in nodes:
        await cp.register(node_id, status="ready")
        assert (await cp.heartbeat(node_id, models=["tiny-llama"], weights=WEIGHTS, load=LOAD)).status_code == 200
    ctx: AppContext = cp.app.state.ctx
    renewal = _renew_statement(postgres=True, cold_start=False)
    digest = report_digest(["tiny-llama"], WEIGHTS)
    with ctx.leases.connect() as conn, conn.begin():
        for node_id in nodes:
            version = conn.execute(renewal, {"b_node_id": node_id, "b_digest": digest, "b_reported": "ready",
                                             "b_load": {**LOAD, "running": 4}}).scalar_one_or_none()
            assert version is not None  # renewed (the report was unchanged)
        updated, hot = conn.execute(text(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'nodes'")).one()
    assert (updated, hot) == (len(nodes), len(nodes))


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_a_renewal_reads_one_row_whatever_the_fleet_grew_to_since_it_was_planned(cp: ControlPlane) -> None:
    """The renewal's prepared statement keeps the plan Postgres chose for it a few executions
    in, for the connection's life: chosen on a fleet of a few nodes, it must still read one
    row by the primary key once the fleet is hundreds. (Before 0013 that plan read the fleet
    by `ix_nodes_status`: 10,020 rows a renewal at 10,000 nodes.) Counted by Postgres for one
    transaction on the connection that prepared it."""
    ctx: AppContext = cp.app.state.ctx
    await cp.register("node-a", status="ready")
    assert (await cp.heartbeat("node-a", models=["tiny-llama"], weights=WEIGHTS, load=LOAD)).status_code == 200
    renewal = _renew_statement(postgres=True, cold_start=False)
    params = {"b_node_id": "node-a", "b_digest": report_digest(["tiny-llama"], WEIGHTS), "b_reported": "ready",
              "b_load": LOAD}
    with ctx.leases.connect() as conn:
        for _ in range(8):  # psycopg prepares it; Postgres settles on a generic plan
            conn.execute(renewal, params)
            conn.commit()
        for i in range(300):  # the fleet grows meanwhile
            await cp.register(f"node-{i:03d}", status="ready")
        with conn.begin():
            for _ in range(10):
                assert conn.execute(renewal, params).scalar_one_or_none() is not None
            fetched = conn.execute(text(
                "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) FROM pg_stat_xact_user_tables "
                "WHERE relname = 'nodes'")).scalar_one()
    # A few row versions a renewal at most (its own, the ones it left in this transaction),
    # where the old plan read all 301 nodes for each.
    assert fetched <= 50
