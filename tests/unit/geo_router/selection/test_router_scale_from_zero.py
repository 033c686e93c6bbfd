"""Scale-from-zero: a router holds requests for a deployed model until a replica turns ready.

A real router long-polls a stand-in control plane (which records scale-up calls) and
forwards to stand-in nodes that the tests publish in the routing table. The router's clock is
a ManualClock: tests move the hold's deadline and the re-ask interval instead of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from router_harness import (
    CLUSTER_TOKEN,
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    SCRAPE,
    NodeBehaviour,
    ServerGroup,
    StandInControlPlane,
    eventually,
    make_table,
    metric,
    node,
    node_app,
    reserve_port,
    router_settings,
    url_of,
)

from geo_router import create_app
from geo_router.state.table import RoutingTableClient, StaticTableSource
from meridian.clock import ManualClock
from meridian.contracts import HEADER_NODE, HEADER_SCALE_WAIT_MS, DeploymentEntry, NodeStatus, RoutingNode

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DEPLOYED = DeploymentEntry(model=MODEL, zone="global", min_replicas=0, max_replicas=2)
# Issue 32's deployment: zone eu, keeps a replica; us nodes serve the model to their own zone.
EU_KEPT = DeploymentEntry(model=MODEL, zone="eu", min_replicas=1, max_replicas=2)


@dataclass
class ColdStart:
    """A router whose table has a deployment of MODEL and, at first, no node."""

    cp: StandInControlPlane
    app: FastAPI
    router_url: str
    node_urls: dict[str, str]
    behaviours: dict[str, NodeBehaviour]
    http: httpx.AsyncClient
    clock: ManualClock

    def publish(self, *nodes: RoutingNode, deployments: list[DeploymentEntry] | None = None) -> None:
        """A new routing table: these nodes, and DEPLOYED unless told otherwise."""
        deps = [DEPLOYED] if deployments is None else deployments
        self.cp.publish(make_table(list(nodes), version=self.cp.table.version + 1, deployments=deps))

    async def published(self) -> None:
        """Until the router has installed the table last published (and woken its waiters)."""
        source = self.app.state.router.table_source
        await eventually(lambda: (t := source.current()) is not None and t.version == self.cp.table.version)

    def node(self, name: str, status: NodeStatus = NodeStatus.READY) -> RoutingNode:
        return node(name, self.node_urls[name], status=status)

    def queued(self) -> int:
        return self.app.state.router.scale_from_zero.queued(MODEL)

    def chat(self, key: str = GLOBAL_KEY, **extra: Any) -> asyncio.Task[httpx.Response]:
        """Send a chat request in the background."""
        return asyncio.create_task(self.http.post(
            "/v1/chat/completions", json=CHAT | extra, headers={"authorization": f"Bearer {key}"}))

    async def metrics(self) -> str:
        return (await self.http.get("/metrics", headers=SCRAPE)).text


@contextlib.asynccontextmanager
async def cold_start(deployments: list[DeploymentEntry] | None = None, **overrides: Any) -> AsyncIterator[ColdStart]:
    backends, front = ServerGroup(), ServerGroup()
    cp = StandInControlPlane(make_table([], deployments=[DEPLOYED] if deployments is None else deployments))
    try:
        behaviours = {name: NodeBehaviour(name) for name in ("us", "eu")}
        urls = {name: await backends.start(node_app(b)) for name, b in behaviours.items()}
        cp_url = await backends.start(cp.app)
        values: dict[str, Any] = {
            "control_plane_url": cp_url,
            "table_poll_timeout_s": 5.0,
            "scale_from_zero_timeout_s": 5.0,
            "scale_from_zero_reask_s": 30.0,
        }
        settings = router_settings(**(values | overrides))
        # The table arrives by real long-polls; the router's own timing is on the clock.
        source = RoutingTableClient(settings, retry_base_s=0.05, retry_max_s=0.2)
        clock = ManualClock()
        app = create_app(settings, table_source=source, clock=clock)
        router_url = await front.start(app)
        async with httpx.AsyncClient(base_url=router_url, timeout=10) as http:
            yield ColdStart(cp, app, router_url, urls, behaviours, http, clock)
    finally:
        await front.stop()
        cp.publish(cp.table)  # answers a long-poll the stopped router left behind
        await backends.stop()


async def test_requests_wait_for_a_replica_and_are_released_when_it_is_ready():
    async with cold_start() as f:
        plain = f.chat()
        streamed = f.chat(stream=True)
        await eventually(lambda: f.queued() == 2)
        await eventually(lambda: len(f.cp.scale_ups) == 1)
        call = f.cp.scale_ups[0]
        assert call.model == MODEL
        assert call.authorization == f"Bearer {CLUSTER_TOKEN}"
        # The nearest region the tenant may use and the deployment may run in.
        assert call.body["zone"] == "global" and call.body["client_region"] == "aws:us-east-1"
        assert call.body["queued_requests"] >= 1 and call.body["reason"] == "scale-from-zero"
        assert metric(await f.metrics(), "meridian_router_scale_from_zero_queued", model=MODEL) == 2

        # A starting replica is not enough.
        f.publish(f.node("us", NodeStatus.STARTING))
        await f.published()
        await f.clock.advance_async(0.3)
        assert not plain.done() and not streamed.done()

        f.publish(f.node("us"))
        r = await asyncio.wait_for(plain, 5)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi from us"
        assert r.headers[HEADER_NODE] == "us-1"
        assert int(r.headers[HEADER_SCALE_WAIT_MS]) >= 300
        s = await asyncio.wait_for(streamed, 5)
        assert s.status_code == 200 and s.text.endswith("data: [DONE]\n\n")
        assert f.behaviours["us"].hits == 2

        text = await f.metrics()
        assert metric(text, "meridian_router_scale_from_zero_queued", model=MODEL) == 0
        assert metric(text, "meridian_router_scale_up_requests_total", model=MODEL, outcome="ok") == 1
        assert metric(text, "meridian_router_scale_from_zero_wait_seconds_count") == 2

        # With a replica ready, nothing waits and nobody is asked to scale.
        r = await f.chat()
        assert r.status_code == 200 and HEADER_SCALE_WAIT_MS not in r.headers
        assert len(f.cp.scale_ups) == 1


async def test_one_scale_up_per_episode_repeated_while_requests_wait():
    async with cold_start(scale_from_zero_reask_s=0.4) as f:
        waiting = [f.chat() for _ in range(3)]
        await eventually(lambda: f.queued() == 3)
        # On the clock: three deadlines, the next ask, and the RTT refinement.
        await eventually(lambda: f.clock.sleepers == 5)
        await f.clock.advance_async(0.2)
        assert len(f.cp.scale_ups) == 1
        # Still waiting: asked again, with how many wait now.
        await f.clock.advance_async(0.2)
        await eventually(lambda: len(f.cp.scale_ups) == 2, timeout_s=2)
        assert f.cp.scale_ups[1].body["queued_requests"] == 3

        f.publish(f.node("us"))
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200] * 3
        calls = len(f.cp.scale_ups)
        await f.clock.advance_async(0.6)
        await f.metrics()  # a round trip's real time, for an ask (were there one) to land
        assert len(f.cp.scale_ups) == calls  # the episode is over: no more asking

        # Scaled back to zero later: a new request opens a new episode.
        f.publish()
        await f.published()
        late = f.chat()
        await eventually(lambda: len(f.cp.scale_ups) == calls + 1)
        f.publish(f.node("us"))
        assert (await late).status_code == 200


async def test_a_full_queue_is_answered_503_with_retry_after_at_once():
    async with cold_start(scale_from_zero_queue_size=2, scale_from_zero_retry_after_s=7,
                          scale_from_zero_tenant_share=1.0) as f:
        waiting = [f.chat(), f.chat()]
        await eventually(lambda: f.queued() == 2)
        started = time.monotonic()
        r = await f.chat()
        assert time.monotonic() - started < 1
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["code"] == "scale_from_zero_queue_full"
        assert metric(await f.metrics(), "meridian_router_scale_from_zero_rejected_total", model=MODEL) == 1

        f.publish(f.node("us"))
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200, 200]


async def test_one_tenant_cannot_fill_the_queue_and_lock_the_others_out():
    """Issue 18: one tenant's burst filled a cold model's queue and every other tenant got 503."""
    async with cold_start(scale_from_zero_queue_size=4, scale_from_zero_retry_after_s=7) as f:
        burst = [f.chat(), f.chat()]
        await eventually(lambda: f.queued() == 2)
        refused = await f.chat()
        assert refused.status_code == 503 and refused.headers["retry-after"] == "7"
        assert refused.json()["error"]["code"] == "scale_from_zero_queue_full"
        assert "2 requests of yours" in refused.json()["error"]["message"]
        # Another tenant still gets in line.
        other = f.chat(EU_KEY)
        await eventually(lambda: f.queued() == 3)
        f.publish(f.node("us"), f.node("eu"))
        assert [r.status_code for r in await asyncio.gather(*burst, other)] == [200, 200, 200]


async def test_past_the_deadline_the_answer_is_503_with_retry_after():
    async with cold_start(scale_from_zero_timeout_s=0.5, scale_from_zero_retry_after_s=3) as f:
        started = f.clock.monotonic()
        plain, streamed = f.chat(), f.chat(stream=True)
        await eventually(lambda: f.queued() == 2)
        # On the clock: two deadlines, the next ask, and the RTT refinement.
        await eventually(lambda: f.clock.sleepers == 4)
        await f.clock.advance_async(0.5)
        for r in (await plain, await streamed):
            assert r.status_code == 503
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["type"] == "service_unavailable_error"
            assert r.json()["error"]["code"] == "model_scaling_from_zero"
            assert "scaling up from zero" in r.json()["error"]["message"]
        assert 0.5 <= f.clock.monotonic() - started < 3
        text = await f.metrics()
        assert metric(text, "meridian_router_scale_from_zero_timeouts_total", model=MODEL) == 2
        assert metric(text, "meridian_router_scale_from_zero_queued", model=MODEL) == 0
        assert len(f.cp.scale_ups) == 1


async def test_a_client_that_hangs_up_leaves_the_queue():
    async with cold_start(scale_from_zero_reask_s=0.2) as f:
        host, port = f.router_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps(CHAT).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {GLOBAL_KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await eventually(lambda: f.queued() == 1)
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: f.queued() == 0)
        assert metric(await f.metrics(), "meridian_router_scale_from_zero_queued", model=MODEL) == 0
        # Nobody waits any more, so nobody asks any more.
        calls = len(f.cp.scale_ups)
        await f.clock.advance_async(0.5)
        await f.metrics()  # a round trip's real time, for an ask (were there one) to land
        assert len(f.cp.scale_ups) == calls


async def test_residency_only_replicas_the_tenant_may_use_count():
    async with cold_start() as f:
        f.publish(f.node("us"))
        await f.published()
        # A global tenant is served by the US replica at once...
        r = await f.chat()
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "us-1"
        # ...an EU tenant may not use it, so it waits, and the scale-up says where to place.
        eu = f.chat(EU_KEY)
        await eventually(lambda: len(f.cp.scale_ups) == 1)
        assert f.cp.scale_ups[0].body["zone"] == "eu"
        assert f.cp.scale_ups[0].body["client_region"] == "gcp:europe-west4"
        await f.clock.advance_async(0.2)
        assert not eu.done()
        f.publish(f.node("us"), f.node("eu"))
        r = await asyncio.wait_for(eu, 5)
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "eu-1"


async def test_a_deployment_that_can_never_serve_the_tenant_is_not_waited_for():
    us_only = DeploymentEntry(model=MODEL, zone="us", min_replicas=0, max_replicas=1)
    async with cold_start(deployments=[us_only]) as f:
        f.publish(f.node("us"), deployments=[us_only])
        await f.published()
        r = await f.chat(EU_KEY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_in_zone"
        assert f.cp.scale_ups == []


async def test_without_a_deployment_the_answers_are_unchanged():
    async with cold_start(deployments=[]) as f:
        r = await f.chat()
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        models = (await f.http.get("/v1/models", headers={"authorization": f"Bearer {GLOBAL_KEY}"})).json()
        assert models["data"] == []
        f.publish(f.node("us", NodeStatus.STARTING), deployments=[])
        await f.published()
        r = await f.chat()
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        assert f.cp.scale_ups == []


async def test_a_deployed_model_is_listed_and_waiters_get_the_usual_answer_if_it_goes():
    async with cold_start() as f:
        models = (await f.http.get("/v1/models", headers={"authorization": f"Bearer {GLOBAL_KEY}"})).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        waiting = f.chat()
        await eventually(lambda: f.queued() == 1)
        f.publish(deployments=[])  # the deployment was deleted
        r = await asyncio.wait_for(waiting, 5)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_scale_up_failures_are_logged_and_the_request_still_waits():
    # No control plane at all: the scale-up call is refused; a static table releases the wait.
    dead = reserve_port()
    servers = ServerGroup()
    try:
        b = NodeBehaviour("us")
        node_url = await servers.start(node_app(b))
        source = StaticTableSource(make_table([], deployments=[DEPLOYED]))
        settings = router_settings(control_plane_url=url_of(dead), scale_from_zero_reask_s=0.1)
        app = create_app(settings, table_source=source)
        router_url = await servers.start(app)
        async with httpx.AsyncClient(base_url=router_url, timeout=10,
                                     headers={"authorization": f"Bearer {GLOBAL_KEY}"}) as http:
            waiting = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
            await eventually(lambda: app.state.router.scale_from_zero.queued(MODEL) == 1)

            def failed_calls() -> float:
                return metric(app.state.router.metrics.render().decode(),
                              "meridian_router_scale_up_requests_total", model=MODEL, outcome="error")

            await eventually(lambda: failed_calls() >= 2)
            source.set(make_table([node("us", node_url)], version=2, deployments=[DEPLOYED]))
            r = await asyncio.wait_for(waiting, 5)
            assert r.status_code == 200 and b.hits == 1
    finally:
        await servers.stop()
        dead.close()


def assert_no_replica_in_zone(r: httpx.Response, retry_after: str) -> None:
    assert r.status_code == 503 and r.headers["retry-after"] == retry_after
    error = r.json()["error"]
    assert error["code"] == "no_replica_in_zone" and "zone `eu`" in error["message"]


async def test_a_zone_that_lost_its_last_replica_is_answered_503_at_once():
    """Issue 32: with the only eu replica gone, eu requests were held without a byte until
    their clients gave up (logged 499, outside the SLO). Nothing is starting there, so
    waiting cannot help: 503 no_replica_in_zone with Retry-After, before any byte."""
    async with cold_start(deployments=[EU_KEPT], no_replica_retry_after_s=9) as f:
        f.publish(f.node("us"), deployments=[EU_KEPT])
        await f.published()
        started = f.clock.monotonic()
        # The router's clock does not move: a request it held would never be answered.
        answers = await asyncio.wait_for(asyncio.gather(f.chat(EU_KEY), f.chat(EU_KEY, stream=True)), 5)
        for r in answers:
            assert_no_replica_in_zone(r, "9")
        assert f.clock.monotonic() == started
        assert f.cp.scale_ups == [] and f.queued() == 0

        # Counted as the router's own 5xx, with why: the availability SLO sees them.
        text = await f.metrics()
        assert metric(text, "meridian_router_requests_total", region="", node="", status="503",
                      reason="no_replica_in_zone") == 2
        assert metric(text, "meridian_router_tenant_requests_total", tenant="eurobank", model=MODEL, zone="eu",
                      status="503") == 2
        # The ready replicas each zone's tenants may use, for the alert.
        assert metric(text, "meridian_router_zone_ready_replicas", zone="eu", model=MODEL) == 0
        assert metric(text, "meridian_router_zone_ready_replicas", zone="global", model=MODEL) == 1
        # Other zones are served as before.
        r = await f.chat()
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "us-1"

        f.publish(f.node("us"), f.node("eu"), deployments=[EU_KEPT])
        await f.published()
        assert metric(await f.metrics(), "meridian_router_zone_ready_replicas", zone="eu", model=MODEL) == 1
        r = await f.chat(EU_KEY)
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "eu-1"


async def test_a_replica_starting_in_the_zone_is_waited_for_up_to_the_bound():
    async with cold_start(deployments=[EU_KEPT], replica_start_wait_s=2.0, no_replica_retry_after_s=9) as f:
        f.publish(f.node("us"), f.node("eu", NodeStatus.STARTING), deployments=[EU_KEPT])
        await f.published()
        started = f.clock.monotonic()
        plain, streamed = f.chat(EU_KEY), f.chat(EU_KEY, stream=True)
        await eventually(lambda: f.queued() == 2)
        await f.clock.advance_async(1.9)
        assert not plain.done() and not streamed.done()
        await f.clock.advance_async(0.1)
        for r in await asyncio.wait_for(asyncio.gather(plain, streamed), 5):
            assert_no_replica_in_zone(r, "9")
        assert f.clock.monotonic() - started == pytest.approx(2.0)
        # No scale-up was asked for: the deployment already wants its replica.
        assert f.cp.scale_ups == [] and f.queued() == 0
        text = await f.metrics()
        assert metric(text, "meridian_router_requests_total", region="", node="", status="503",
                      reason="no_replica_in_zone") == 2
        assert metric(text, "meridian_router_scale_from_zero_timeouts_total", model=MODEL) == 0


async def test_a_starting_replica_that_turns_ready_serves_and_one_that_goes_ends_the_wait():
    async with cold_start(deployments=[EU_KEPT], replica_start_wait_s=30.0) as f:
        f.publish(f.node("us"), f.node("eu", NodeStatus.STARTING), deployments=[EU_KEPT])
        await f.published()
        waiting = f.chat(EU_KEY)
        await eventually(lambda: f.queued() == 1)
        await f.clock.advance_async(0.5)
        f.publish(f.node("us"), f.node("eu"), deployments=[EU_KEPT])
        r = await asyncio.wait_for(waiting, 5)
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "eu-1"
        assert int(r.headers[HEADER_SCALE_WAIT_MS]) >= 500

        # Starting again, then gone before it was ready: the waiter is answered at once.
        f.publish(f.node("us"), f.node("eu", NodeStatus.STARTING), deployments=[EU_KEPT])
        await f.published()
        waiting = f.chat(EU_KEY)
        await eventually(lambda: f.queued() == 1)
        f.publish(f.node("us"), deployments=[EU_KEPT])
        assert_no_replica_in_zone(await asyncio.wait_for(waiting, 5), "5")
        assert f.cp.scale_ups == []
