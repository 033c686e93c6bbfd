"""Node lifecycle and the routing table as routers and nodes see them."""

from __future__ import annotations

import asyncio

import httpx
from cp_harness import REAPER, ControlPlane, on_manual_clock, until

from control_plane.app import create_app
from control_plane.version_watch import DEFAULT_RECHECK_S
from meridian.clock import ManualClock
from meridian.contracts import NodeCapability, RoutingNode
from meridian.settings.control_plane import ControlPlaneSettings


async def test_register_heartbeat_and_routing_table(cp: ControlPlane) -> None:
    v0 = await cp.version()

    r = await cp.register("node-a", region="gcp:europe-west4", version="0.1.0")
    assert r.status_code == 200
    assert r.json() == {
        "node_id": "node-a",
        "heartbeat_interval_s": cp.settings.heartbeat_interval_s,
        "ttl_s": cp.settings.node_ttl_s,
    }

    r = await cp.heartbeat("node-a", load={"running": 1, "waiting": 0, "kv_cache_usage": 0.5})
    assert r.status_code == 200
    v_ready = r.json()["routing_version"]
    assert v_ready > v0

    r = await cp.table()
    assert r.status_code == 200
    table = r.json()
    assert r.headers["etag"] == f'"{table["version"]}"'
    assert table["version"] == v_ready
    assert table["nodes"] == [
        {
            "node_id": "node-a",
            "region": "gcp:europe-west4",
            "url": "http://node-a.test:8000",
            "models": ["tiny-llama"],
            "status": "ready",
            "engine": "torch",
        }
    ]
    region_names = {reg["name"] for reg in table["regions"]}
    assert {"aws:us-east-1", "gcp:europe-west4", "onprem:tokyo-1"} <= region_names

    r = await cp.table(**{"if-none-match": r.headers["etag"]})
    assert r.status_code == 304
    assert r.headers["etag"] == f'"{v_ready}"'
    assert r.content == b""

    r = await cp.table(**{"if-none-match": f'"{v0}"'})
    assert r.status_code == 200


async def test_load_only_heartbeats_keep_the_version(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready")
    v = await cp.version()
    for running in range(3):
        r = await cp.heartbeat("node-a", load={"running": running, "waiting": 2, "kv_cache_usage": 0.1,
                                                   "lora_adapters": ["support"]})
        assert r.json()["routing_version"] == v
    assert await cp.version() == v

    nodes = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()
    assert nodes[0]["load"] == {"running": 2, "waiting": 2, "kv_cache_usage": 0.1,
                                "lora_adapters": ["support"]}

    r = await cp.heartbeat("node-a", status="draining")
    assert r.json()["routing_version"] == v + 1
    r = await cp.heartbeat("node-a", status="draining", models=["tiny-llama", "other"])
    assert r.json()["routing_version"] == v + 2
    table = (await cp.table()).json()
    assert table["nodes"][0]["status"] == "draining"
    assert table["nodes"][0]["models"] == ["tiny-llama", "other"]


async def test_reregistration_updates_the_node(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready")
    v = await cp.version()
    r = await cp.register("node-a", url="http://moved.test:9000", status="starting")
    assert r.status_code == 200
    table = (await cp.table()).json()
    assert table["version"] == v + 1
    assert [(n["url"], n["status"]) for n in table["nodes"]] == [("http://moved.test:9000", "starting")]


async def test_kv_event_endpoints_reach_the_routing_table(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready", kv_events="tcp://10.0.0.5:5557",
                      kv_events_replay="tcp://10.0.0.5:5558")
    v = await cp.version()
    node = (await cp.table()).json()["nodes"][0]
    assert (node["kv_events"], node["kv_events_replay"]) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")

    # Routers must reconnect when a node moves its publisher: a new routing version.
    await cp.register("node-a", status="ready", kv_events="tcp://10.0.0.5:6000")
    table = (await cp.table()).json()
    assert table["version"] == v + 1
    assert table["nodes"][0]["kv_events"] == "tcp://10.0.0.5:6000"
    assert "kv_events_replay" not in table["nodes"][0]

    # A wildcard bind address is no endpoint a router can connect to.
    r = await cp.register("node-a", kv_events="tcp://*:5557")
    assert r.status_code == 422


async def test_the_tool_call_parser_reaches_the_routing_table(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready", engine="vllm", tool_call_parser="pythonic")
    v = await cp.version()
    assert (await cp.table()).json()["nodes"][0]["tool_call_parser"] == "pythonic"

    # Routers must stop resuming its tool-call streams when the node changes parser.
    await cp.register("node-a", status="ready", engine="vllm", tool_call_parser="hermes")
    table = (await cp.table()).json()
    assert table["version"] == v + 1 and table["nodes"][0]["tool_call_parser"] == "hermes"

    # A node that parses no tool calls advertises none, and old routers see no new field.
    await cp.register("node-a", status="ready", engine="vllm")
    table = (await cp.table()).json()
    assert table["version"] == v + 2 and "tool_call_parser" not in table["nodes"][0]

    for bad in ("", "py thonic", "x" * 65, "pythonic\n", "../etc"):
        r = await cp.register("node-a", tool_call_parser=bad)
        assert r.status_code == 422, bad


async def test_what_a_node_can_do_reaches_the_routing_table_and_an_older_agents_node_says_nothing(
    cp: ControlPlane,
) -> None:
    await cp.register("node-a", status="ready", engine="vllm", capabilities=["stop_string_in_output"])
    v = await cp.version()
    node = RoutingNode.model_validate((await cp.table()).json()["nodes"][0])
    assert node.capabilities == [NodeCapability.STOP_STRING_IN_OUTPUT]
    assert node.can(NodeCapability.STOP_STRING_IN_OUTPUT) and not node.can(NodeCapability.CHAT_SPECIAL_TOKENS)

    # A change is a new version: routers must shape requests to what the node now does.
    await cp.register("node-a", status="ready", engine="vllm", capabilities=[])
    table = (await cp.table()).json()
    assert table["version"] == v + 1 and table["nodes"][0]["capabilities"] == []

    # An older agent registers none: the table leaves the field out, and routers take what
    # the engine kind did (a vLLM node could do both).
    await cp.register("node-a", status="ready", engine="vllm")
    table = (await cp.table()).json()
    assert table["version"] == v + 2 and "capabilities" not in table["nodes"][0]
    node = RoutingNode.model_validate(table["nodes"][0])
    assert node.can(NodeCapability.STOP_STRING_IN_OUTPUT) and node.can(NodeCapability.CHAT_SPECIAL_TOKENS)

    for bad in (["telepathy"], "stop_string_in_output", ["stop_string_in_output"] * 33):
        r = await cp.register("node-a", capabilities=bad)
        assert r.status_code == 422, bad


async def test_a_nodes_batch_slots_reach_the_routing_table_and_an_older_agents_node_says_none(
    cp: ControlPlane,
) -> None:
    await cp.register("node-a", status="ready", max_num_seqs=24)
    v = await cp.version()
    assert (await cp.table()).json()["nodes"][0]["max_num_seqs"] == 24
    # A change is a new version: routers' flow control fills the node to its new batch.
    await cp.register("node-a", status="ready", max_num_seqs=8)
    table = (await cp.table()).json()
    assert table["version"] == v + 1 and table["nodes"][0]["max_num_seqs"] == 8
    await cp.register("node-a", status="ready")
    table = (await cp.table()).json()
    assert table["version"] == v + 2 and "max_num_seqs" not in table["nodes"][0]
    for bad in (0, -1, "many", 1 << 20):
        r = await cp.register("node-a", max_num_seqs=bad)
        assert r.status_code == 422, bad


async def test_a_disaggregated_nodes_role_and_kv_transfer_reach_the_table_and_status(cp: ControlPlane) -> None:
    transfer = {"connector": "NixlConnector", "endpoint": "10.0.0.7:5600", "lease_s": 30.0}
    await cp.register("node-p", status="ready", role="prefill", kv_transfer=transfer)
    await cp.register("node-d", status="ready", role="decode",
                      kv_transfer={**transfer, "endpoint": "10.0.0.8:5600"})
    await cp.register("node-c", status="ready")
    v = await cp.version()
    table = (await cp.table()).json()
    by_id = {n["node_id"]: n for n in table["nodes"]}
    assert (by_id["node-p"]["role"], by_id["node-p"]["kv_transfer"]) == ("prefill", transfer)
    assert by_id["node-d"]["role"] == "decode"
    assert by_id["node-d"]["kv_transfer"]["endpoint"] == "10.0.0.8:5600"
    # A co-located node sends what it always did: old routers see no new field.
    assert "role" not in by_id["node-c"] and "kv_transfer" not in by_id["node-c"]

    nodes = {n["node_id"]: n for n in (await cp.http.get("/v1/nodes", headers=cp.admin)).json()}
    assert (nodes["node-p"]["role"], nodes["node-p"]["kv_transfer"]) == ("prefill", transfer)
    assert "role" not in nodes["node-c"]

    # Routers must re-pair when a node changes role or moves its KV endpoint.
    await cp.register("node-p", status="ready", role="decode", kv_transfer=transfer)
    assert (await cp.version()) == v + 1
    await cp.register("node-p", status="ready", role="decode", kv_transfer={**transfer, "endpoint": "10.0.0.7:5700"})
    assert (await cp.version()) == v + 2
    # A load-only heartbeat changes nothing routers see.
    await cp.heartbeat("node-p", load={"running": 0, "waiting": 3, "kv_cache_usage": 0.0,
                                        "waiting_prompt_tokens": 4096})
    assert (await cp.version()) == v + 2
    node = (await cp.http.get("/v1/nodes/node-p", headers=cp.admin)).json()
    assert node["load"]["waiting_prompt_tokens"] == 4096 and node["role"] == "decode"

    # Back to co-located: the transfer goes with the role.
    await cp.register("node-p", status="ready")
    node = next(n for n in (await cp.table()).json()["nodes"] if n["node_id"] == "node-p")
    assert "role" not in node and "kv_transfer" not in node


async def test_a_disaggregated_node_without_a_usable_kv_transfer_is_refused(cp: ControlPlane) -> None:
    transfer = {"connector": "NixlConnector", "endpoint": "10.0.0.7:5600", "lease_s": 30.0}
    for fields in (
        {"role": "prefill"},
        {"role": "decode", "kv_transfer": None},
        {"role": "router", "kv_transfer": transfer},
        {"role": "prefill", "kv_transfer": {**transfer, "endpoint": "10.0.0.7"}},
        {"role": "prefill", "kv_transfer": {**transfer, "connector": "LMCacheConnector"}},
        {"role": "prefill", "kv_transfer": {**transfer, "lease_s": 0}},
    ):
        r = await cp.register("node-x", **fields)
        assert r.status_code == 422, fields
    assert (await cp.table()).json()["nodes"] == []


async def test_deregistered_node_leaves_the_table(cp: ControlPlane) -> None:
    await cp.register("node-a")
    v = await cp.version()
    r = await cp.http.delete("/v1/nodes/node-a", headers=cp.internal)
    assert r.status_code == 204
    table = (await cp.table()).json()
    assert table["nodes"] == []
    assert table["version"] == v + 1
    # Deleting again is harmless: a retried shutdown must not fail.
    r = await cp.http.delete("/v1/nodes/node-a", headers=cp.internal)
    assert r.status_code == 204
    assert await cp.version() == v + 1


@on_manual_clock
async def test_long_poll_returns_when_a_node_registers(cp: ControlPlane, clock: ManualClock) -> None:
    etag = (await cp.table()).headers["etag"]
    loop = asyncio.get_running_loop()
    started = loop.time()
    poll = asyncio.create_task(
        cp.http.get("/v1/routing-table", params={"wait": 5}, headers={**cp.internal, "if-none-match": etag})
    )
    await until(lambda: clock.sleepers >= REAPER + 1)  # the poll waits
    assert not poll.done()
    await cp.register("node-a")
    r = await asyncio.wait_for(poll, 3)
    assert loop.time() - started < 3
    assert r.status_code == 200
    assert r.headers["etag"] != etag
    assert [n["node_id"] for n in r.json()["nodes"]] == ["node-a"]


async def test_long_poll_without_change_ends_with_304(cp: ControlPlane) -> None:
    etag = (await cp.table()).headers["etag"]
    loop = asyncio.get_running_loop()
    started = loop.time()
    r = await cp.http.get(
        "/v1/routing-table", params={"wait": 0.5}, headers={**cp.internal, "if-none-match": etag}
    )
    assert r.status_code == 304
    assert r.headers["etag"] == etag
    assert 0.4 < loop.time() - started < 3


async def test_unknown_region_is_a_400_problem(cp: ControlPlane) -> None:
    r = await cp.register("node-a", region="aws:mars-north-1")
    body = cp.assert_problem(r, 400)
    assert "aws:mars-north-1" in body["detail"]
    assert (await cp.table()).json()["nodes"] == []


async def test_internal_endpoints_need_the_cluster_token(cp: ControlPlane) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic abc"}):
        r = await cp.http.get("/v1/routing-table", headers=headers)
        cp.assert_problem(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
        r = await cp.http.post(
            "/v1/nodes/register",
            json={"node_id": "n", "region": "aws:us-east-1", "url": "http://n:1"},
            headers=headers,
        )
        cp.assert_problem(r, 401)
    # An admin API key is not the cluster token.
    cp.assert_problem(await cp.http.get("/v1/routing-table", headers=cp.admin), 401)


async def test_heartbeat_of_unknown_node_is_404(cp: ControlPlane) -> None:
    r = await cp.heartbeat("ghost")
    body = cp.assert_problem(r, 404)
    assert "register" in body["detail"]


async def test_invalid_registration_is_a_422_problem(cp: ControlPlane) -> None:
    r = await cp.register("Not_A_Valid_Id", url="ftp://x")
    body = cp.assert_problem(r, 422)
    fields = {tuple(e["loc"]) for e in body["errors"]}
    assert ("body", "node_id") in fields
    assert ("body", "url") in fields


async def test_concurrent_writes_each_answer_with_a_version_that_covers_them(cp: ControlPlane) -> None:
    """Registrations and starting -> ready changes racing each other: the version moves past
    every one of them (a router waiting on the old version wakes and sees them all), though
    writes that commit together may share one bump (control_plane.version_bumper)."""
    v = await cp.version()
    N = cp.app.state.ctx.settings.max_concurrent_registrations  # all admitted at once
    registered = await asyncio.gather(*(cp.register(f"node-{i}") for i in range(N)))
    assert [r.status_code for r in registered] == [200] * N
    after_registrations = await cp.version()
    beats = await asyncio.gather(*(cp.heartbeat(f"node-{i}") for i in range(N)))
    assert [r.status_code for r in beats] == [200] * N
    # Each ack names a version bumped after its own change, so after every registration's.
    assert all(r.json()["routing_version"] > after_registrations > v for r in beats)
    table = (await cp.table()).json()
    assert table["version"] >= max(r.json()["routing_version"] for r in beats)
    assert sorted((n["node_id"], n["status"]) for n in table["nodes"]) == sorted(
        (f"node-{i}", "ready") for i in range(N))
    assert table["version"] <= v + 2 * N  # never more than one bump per write


@on_manual_clock
async def test_long_poll_sees_changes_made_by_another_control_plane(
    cp: ControlPlane, settings: ControlPlaneSettings, clock: ManualClock
) -> None:
    """Two control-plane processes on one database: a bump on one wakes polls on the other
    (at its next re-check of the version)."""
    other = create_app(settings)
    async with other.router.lifespan_context(other):
        transport = httpx.ASGITransport(app=other)
        async with httpx.AsyncClient(transport=transport, base_url="http://other.test") as http:
            etag = (await cp.table()).headers["etag"]
            poll = asyncio.create_task(
                cp.http.get(
                    "/v1/routing-table",
                    params={"wait": 5},
                    headers={**cp.internal, "if-none-match": etag},
                )
            )
            await until(lambda: clock.sleepers >= REAPER + 1)  # the poll waits
            body = {"node_id": "elsewhere", "region": "aws:us-east-1", "url": "http://e:1"}
            r = await http.post("/v1/nodes/register", json=body, headers=cp.internal)
            assert r.status_code == 200
            clock.advance(DEFAULT_RECHECK_S)
            r = await asyncio.wait_for(poll, 4)
            assert r.status_code == 200
            assert [n["node_id"] for n in r.json()["nodes"]] == ["elsewhere"]
