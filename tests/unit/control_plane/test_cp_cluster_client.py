"""The kernel's cluster client against the real control plane (SQLite and Postgres): every call
nodes and routers make, its typed answers, and its one error type for a refusal, an
unreachable control plane and an answer that does not parse."""

from __future__ import annotations

import httpx
import pytest
from cp_harness import CLUSTER_TOKEN, ControlPlane
from pydantic import SecretStr
from router_harness import reserve_port, url_of
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meridian.cluster_client import ClusterAPIError, ClusterClient, ClusterEndpoint
from meridian.contracts import (
    NodeHeartbeat,
    NodeRegistration,
    NodeStatus,
    ScaleUpRequest,
    WeightSourcesRequest,
)

DIGEST = "cd" * 32


def _client(app: object, token: str | None = CLUSTER_TOKEN) -> ClusterClient:
    endpoint = ClusterEndpoint("http://cp.test", SecretStr(token) if token else None, 5.0)
    return ClusterClient(endpoint, transport=httpx.ASGITransport(app=app))  # type: ignore[arg-type]


def _node(node_id: str, region: str = "aws:us-east-1") -> NodeRegistration:
    return NodeRegistration(node_id=node_id, region=region, url=f"http://{node_id}.test:8000", models=["tiny-llama"])


async def test_a_node_registers_heartbeats_and_leaves(cp: ControlPlane) -> None:
    async with _client(cp.app) as cluster:
        registered = await cluster.register(_node("n1"))
        assert registered.heartbeat_interval_s > 0
        ack = await cluster.heartbeat("n1", NodeHeartbeat(status=NodeStatus.READY, models=["tiny-llama"]))
        assert ack is not None
        listed = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()
        assert [(n["node_id"], n["status"]) for n in listed] == [("n1", "ready")]

        await cluster.deregister("n1")
        await cluster.deregister("n1")  # gone already: not a failure
        # A heartbeat the control plane cannot place says so: the node registers again.
        assert await cluster.heartbeat("n1", NodeHeartbeat(status=NodeStatus.READY)) is None


async def test_the_routing_table_whole_then_unchanged_then_as_a_delta(cp: ControlPlane) -> None:
    async with _client(cp.app) as cluster:
        await cluster.register(_node("n1"))
        await cluster.heartbeat("n1", NodeHeartbeat(status=NodeStatus.READY, models=["tiny-llama"]))
        first = await cluster.routing_table()
        assert first.table is not None and first.build
        assert [n.node_id for n in first.table.nodes] == ["n1"]

        same = await cluster.routing_table(version=first.table.version, build=first.build)
        assert same.unchanged

        await cluster.register(_node("n2"))
        await cluster.heartbeat("n2", NodeHeartbeat(status=NodeStatus.READY, models=["tiny-llama"]))
        changed = await cluster.routing_table(version=first.table.version, build=first.build)
        assert changed.delta is not None and changed.table is None
        assert changed.delta.base_version == first.table.version
        assert [n.node_id for n in changed.delta.nodes_upserted] == ["n2"]
        # Without a build held, the same question gets the whole table.
        whole = await cluster.routing_table(version=first.table.version)
        assert whole.table is not None and {n.node_id for n in whole.table.nodes} == {"n1", "n2"}


async def test_weight_sources_and_a_zone_the_node_may_not_hold(cp: ControlPlane) -> None:
    async with _client(cp.app) as cluster:
        await cluster.register(_node("us-1"))
        await cluster.register(_node("us-2"))
        first = await cluster.weight_sources(DIGEST, WeightSourcesRequest(node_id="us-1"))
        assert first.peers == [] and "us" in first.node_zones  # the first asker goes to the origin
        second = await cluster.weight_sources(DIGEST, WeightSourcesRequest(node_id="us-2"))
        assert [p.node_id for p in second.peers] == ["us-1"]
        await cluster.withdraw_weights(DIGEST, "us-1")
        assert (await cluster.weight_sources(DIGEST, WeightSourcesRequest(node_id="us-2"))).peers == []

        with pytest.raises(ClusterAPIError) as refused:
            await cluster.weight_sources(DIGEST, WeightSourcesRequest(node_id="us-1", zone="eu"))
        assert refused.value.status == 403 and "zone 'eu'" in refused.value.detail


async def test_refusals_are_typed_with_the_problems_detail(cp: ControlPlane) -> None:
    async with _client(cp.app) as cluster:
        with pytest.raises(ClusterAPIError) as unknown:
            await cluster.scale_up("org/none", ScaleUpRequest(queued_requests=1))
        assert unknown.value.status == 404 and not unknown.value.unreachable
    async with _client(cp.app, token="not-the-token") as stranger:
        with pytest.raises(ClusterAPIError) as denied:
            await stranger.register(_node("n1"))
        assert denied.value.status == 401
    assert (await cp.http.get("/v1/nodes", headers=cp.admin)).json() == []


async def test_a_busy_answer_carries_its_retry_after_and_junk_is_not_an_answer() -> None:
    async def busy(_request: Request) -> Response:
        return Response('{"title": "Too Many Requests", "detail": "your turn is in 7 s"}', status_code=429,
                        headers={"retry-after": "7", "content-type": "application/problem+json"})

    async def junk(_request: Request) -> Response:
        return Response("<html>a proxy's page</html>", media_type="text/html")

    app = Starlette(routes=[Route("/v1/nodes/register", busy, methods=["POST"]),
                            Route("/v1/routing-table", junk)])
    async with _client(app) as cluster:
        with pytest.raises(ClusterAPIError) as turn:
            await cluster.register(_node("n1"))
        assert (turn.value.status, turn.value.retry_after_s, turn.value.detail) == (429, 7.0, "your turn is in 7 s")
        with pytest.raises(ClusterAPIError, match="RoutingTable does not parse") as junked:
            await cluster.routing_table()
        assert junked.value.unreachable


async def test_an_unreachable_control_plane_is_status_zero_within_the_timeout() -> None:
    closed = reserve_port()  # bound, never listening
    try:
        async with ClusterClient(ClusterEndpoint(url_of(closed), None, 2.0)) as cluster:
            with pytest.raises(ClusterAPIError) as gone:
                await cluster.heartbeat("n1", NodeHeartbeat(status=NodeStatus.READY))
        assert gone.value.unreachable and isinstance(gone.value.__cause__, httpx.ConnectError)
    finally:
        closed.close()
