"""The routing table as a stream of deltas (control_plane.table_stream): a router that follows
the real control plane by deltas holds exactly the table a full fetch gives; one build serves
every waiting router; a build the control plane no longer holds gets the full table.
On SQLite and on Postgres."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from cp_harness import CLUSTER_TOKEN, ControlPlane
from pydantic import SecretStr
from sqlalchemy import delete, update

from control_plane.context import AppContext
from control_plane.db.models import Node, RoutingState
from geo_router.state.snapshot import read_snapshot
from geo_router.state.table import LoadedTable, RoutingTableClient
from meridian.contracts import HEADER_TABLE_BUILD, TABLE_DELTA_IM, RoutingTable, RoutingTableDelta
from meridian.settings.router import RouterSettings

REGIONS = ["aws:us-east-1", "aws:eu-west-1", "gcp:europe-west4"]
MODELS = ["tiny-llama", "qwen", "mistral"]
TRANSFER = {"connector": "NixlConnector", "endpoint": "10.0.0.7:5600", "lease_s": 30.0}


def ctx_of(cp: ControlPlane) -> AppContext:
    ctx: AppContext = cp.app.state.ctx
    return ctx


@asynccontextmanager
async def following(cp: ControlPlane, snapshot: Path | None = None) -> AsyncIterator[RoutingTableClient]:
    """A router's real table client, long-polling this control plane in-process."""
    settings = RouterSettings(
        control_plane_url="http://cp.test", cluster_token=SecretStr(CLUSTER_TOKEN), table_poll_timeout_s=5.0,
        snapshot_path=snapshot,
    )
    client = RoutingTableClient(settings, transport=httpx.ASGITransport(app=cp.app))
    await client.start()
    try:
        yield client
    finally:
        await client.stop()


async def full_table(cp: ControlPlane) -> bytes:
    r = await cp.table()
    assert r.status_code == 200
    return r.content


async def caught_up(client: RoutingTableClient, cp: ControlPlane) -> bytes:
    """Once the client holds the control plane's current version: the full table's bytes."""
    body = await full_table(cp)
    await client.wait_for_version(RoutingTable.model_validate_json(body).version, timeout_s=10)
    return body


async def random_change(cp: ControlPlane, rng: random.Random, nodes: list[str]) -> None:
    """One change a fleet makes: a node joins, changes status or models, leaves; a key appears."""
    action = rng.choice(["join", "join", "status", "status", "models", "leave", "key"])
    if action == "join" or not nodes:
        node_id = f"node-{rng.randrange(10_000):04d}"
        extra = rng.choice([{}, {"tool_call_parser": "pythonic"}, {"role": "prefill", "kv_transfer": TRANSFER}])
        r = await cp.register(node_id, region=rng.choice(REGIONS), models=[rng.choice(MODELS)], status="ready",
                              **extra)
        assert r.status_code == 200, r.text
        if node_id not in nodes:
            nodes.append(node_id)
    elif action == "status":
        r = await cp.heartbeat(rng.choice(nodes), status=rng.choice(["ready", "draining"]))
        assert r.status_code == 200, r.text
    elif action == "models":
        r = await cp.heartbeat(rng.choice(nodes), models=rng.sample(MODELS, 2))
        assert r.status_code == 200, r.text
    elif action == "leave":
        node_id = nodes.pop(rng.randrange(len(nodes)))
        r = await cp.http.delete(f"/v1/nodes/{node_id}", headers=cp.internal)
        assert r.status_code == 204, r.text
    else:
        tenant = f"t{rng.randrange(1000)}"
        r = await cp.create_key(name=tenant, tenant=tenant, zone="global")
        assert r.status_code == 201, r.text


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_router_following_by_deltas_holds_exactly_the_full_table(
    cp: ControlPlane, seed: int, tmp_path: Path
):
    rng = random.Random(seed)
    nodes: list[str] = []
    for _ in range(5):
        await random_change(cp, rng, nodes)
    snapshot = tmp_path / "routing-table.json"
    async with following(cp, snapshot) as client:
        for step in range(25):
            # One change, or a burst the router sees as one delta over several versions.
            for _ in range(rng.choice([1, 1, 3])):
                await random_change(cp, rng, nodes)
            body = await caught_up(client, cp)
            held = client.current()
            assert held is not None
            assert held.table.model_dump_json().encode() == body, f"step {step}"
            # Its lookups, updated delta by delta, are those of the table built afresh.
            assert held == LoadedTable.build(RoutingTable.model_validate_json(body)), f"step {step}"
    # After the first full table, every change came as a delta.
    assert client.full_tables == 1
    assert client.deltas_applied >= 25
    # The table built from deltas is what a restarted router reads back from its snapshot.
    saved = read_snapshot(snapshot)
    assert saved is not None and saved.model_dump_json().encode() == body


async def test_concurrent_long_polls_share_one_build_and_one_delta(cp: ControlPlane):
    await cp.register("n-1")
    first = await cp.table()
    version, build = int(first.json()["version"]), first.headers[HEADER_TABLE_BUILD]
    tables = ctx_of(cp).tables
    builds_before, deltas_before = tables.builds, tables.deltas_computed
    headers = {
        **cp.internal, "if-none-match": f'"{version}"', "a-im": TABLE_DELTA_IM, HEADER_TABLE_BUILD: build,
    }
    polls = [asyncio.create_task(cp.http.get("/v1/routing-table", params={"wait": "5"}, headers=headers))
             for _ in range(20)]
    await asyncio.sleep(0.2)  # let them reach the long-poll; any that are late share the build too
    await cp.register("n-2")
    answers = await asyncio.gather(*polls)
    assert {r.status_code for r in answers} == {226}
    assert len({r.content for r in answers}) == 1
    delta = RoutingTableDelta.model_validate_json(answers[0].content)
    assert (delta.base_version, delta.base_build) == (version, build)
    assert [n.node_id for n in delta.nodes_upserted] == ["n-2"] and delta.nodes_removed == []
    assert delta.tenants is None and delta.regions is None
    assert tables.builds - builds_before == 1
    assert tables.deltas_computed - deltas_before == 1
    # The full table of that build is the one a router without a base gets.
    full = await cp.table()
    assert full.headers[HEADER_TABLE_BUILD] == delta.build == answers[0].headers[HEADER_TABLE_BUILD]
    assert tables.builds - builds_before == 1


@pytest.mark.parametrize("settings_overrides", [{"routing_history_versions": 2}], ids=["history-2"])
async def test_a_build_no_longer_held_or_never_built_here_gets_the_full_table(cp: ControlPlane):
    await cp.register("n-1")
    old = await cp.table()
    base = {"a-im": TABLE_DELTA_IM, "if-none-match": old.headers["etag"]}
    # Two more builds: the history keeps two, so the first is gone.
    for node_id in ("n-2", "n-3"):
        await cp.register(node_id)
        assert (await cp.table()).status_code == 200
    too_old = await cp.table(**base, **{HEADER_TABLE_BUILD: old.headers[HEADER_TABLE_BUILD]})
    assert too_old.status_code == 200
    assert [n["node_id"] for n in too_old.json()["nodes"]] == ["n-1", "n-2", "n-3"]
    # A build of that version this process never made (another replica's, say): full table.
    other = await cp.table(**{**base, "if-none-match": '"1"'}, **{HEADER_TABLE_BUILD: "another-replica"})
    assert other.status_code == 200 and other.content == too_old.content
    # A build still held gets a delta to the newest.
    held = ctx_of(cp).tables.held()[0]
    recent = await cp.table(**{"a-im": TABLE_DELTA_IM, "if-none-match": f'"{held[0]}"', HEADER_TABLE_BUILD: held[1]})
    assert recent.status_code == 226 and recent.headers["im"] == TABLE_DELTA_IM
    assert [n.node_id for n in RoutingTableDelta.model_validate_json(recent.content).nodes_upserted] == ["n-3"]


async def test_without_a_base_build_or_a_im_the_answer_is_the_full_table(cp: ControlPlane):
    """What a router of an older version (no deltas) asks keeps its answer."""
    await cp.register("n-1")
    first = await cp.table()
    await cp.register("n-2")
    build = {HEADER_TABLE_BUILD: first.headers[HEADER_TABLE_BUILD]}
    for headers in ({"if-none-match": first.headers["etag"]}, {"if-none-match": first.headers["etag"], **build}):
        r = await cp.table(**headers)
        assert r.status_code == 200 and len(r.json()["nodes"]) == 2


async def test_a_database_whose_version_went_back_is_followed_not_the_builds_of_before(cp: ControlPlane):
    await cp.register("n-1")
    await cp.register("n-2")
    before = await cp.table()
    assert before.status_code == 200 and before.json()["version"] >= 2
    # As a restore from a backup would: the version goes back (and n-2 with it).
    with ctx_of(cp).write_sessions() as session, session.begin():
        session.execute(delete(Node).where(Node.node_id == "n-2"))
        session.execute(update(RoutingState).values(version=1))
    r = await cp.table(**{"if-none-match": before.headers["etag"]})
    assert r.status_code == 200 and r.headers["etag"] == '"1"'
    assert [n["node_id"] for n in r.json()["nodes"]] == ["n-1"]
