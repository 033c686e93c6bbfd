"""Flow control through a real router: a stand-in node that registered two batch slots takes
two streams, the third request waits at the router (not at the node) and goes when a stream
ends; a request past its queue TTL is answered 503 queue_timeout with Retry-After, as the
openai client reads it; a client that leaves while queued is never sent; a priority above
what the key allows is refused; while requests wait the router reports them to its control
plane, and once more when none do. The router's clock is a ManualClock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from router_harness import (
    EU_KEY,
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
    router_settings,
    started_stream,
)

from geo_router import create_app
from geo_router.state.table import StaticTableSource
from meridian.clock import ManualClock

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
EU = {"authorization": f"Bearer {EU_KEY}"}
WAITING = "meridian_router_flow_waiting"


@dataclass
class Saturated:
    app: FastAPI
    url: str
    node: NodeBehaviour
    http: httpx.AsyncClient
    clock: ManualClock

    def waiting(self) -> int:
        return sum(self.app.state.router.flow.gauges().waiting.values())

    async def metrics(self) -> str:
        return (await self.http.get("/metrics", headers=SCRAPE)).text


@contextlib.asynccontextmanager
async def one_slow_node(**overrides: Any) -> AsyncIterator[Saturated]:
    """A router in front of one eu node with two batch slots whose streams hold until released."""
    servers = ServerGroup()
    behaviour = NodeBehaviour("eu", mode="slow")
    try:
        url = await servers.start(node_app(behaviour))
        table = make_table([node("eu", url).model_copy(update={"max_num_seqs": 2})])
        settings = router_settings(probe_enabled=False, flow_reserve_share=0.0, **overrides)
        clock = ManualClock()
        app = create_app(settings, table_source=StaticTableSource(table), clock=clock)
        router_url = await servers.start(app)
        async with httpx.AsyncClient(base_url=router_url, timeout=10) as http:
            yield Saturated(app, router_url, behaviour, http, clock)
    finally:
        behaviour.release.set()
        await servers.stop()


async def test_the_third_request_waits_at_the_router_and_goes_when_a_stream_ends() -> None:
    async with one_slow_node() as f, contextlib.AsyncExitStack() as stack:
        streams = [await started_stream(f.http, stack, CHAT, EU) for _ in range(2)]
        third = asyncio.ensure_future(f.http.post("/v1/chat/completions", json=CHAT, headers=EU))
        await eventually(lambda: f.waiting() == 1)
        assert f.node.hits == 2  # held here, not queued at the node
        assert metric(await f.metrics(), WAITING, zone="eu", model=MODEL, band="0", tenant="eurobank") == 1
        f.node.release.set()  # the streams end: their slots come back
        for lines in streams:
            async for _ in lines:
                pass
        answer = await asyncio.wait_for(third, 10)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hi from eu"
        assert f.waiting() == 0
        text = await f.metrics()
        # The histogram is of the requests that waited: the third, not the streams.
        assert metric(text, "meridian_router_flow_wait_seconds_count", zone="eu", band="0", tenant="eurobank") == 1


async def test_the_router_tells_its_control_plane_what_waits_and_when_nothing_does() -> None:
    async with contextlib.AsyncExitStack() as stack:
        cp = StandInControlPlane(make_table([]))
        cp_url = await stack.enter_async_context(cp.serving())
        f = await stack.enter_async_context(
            one_slow_node(control_plane_url=cp_url, flow_backlog_report_s=2.0, router_id="edge-eu-1"))
        streams = [await started_stream(f.http, stack, CHAT, EU) for _ in range(2)]
        third = asyncio.ensure_future(f.http.post("/v1/chat/completions", json=CHAT, headers=EU))
        await eventually(lambda: f.waiting() == 1)
        await f.clock.advance_async(2.0)
        await eventually(lambda: len(cp.backlogs) == 1)
        assert cp.backlogs == [("edge-eu-1", {"pools": [{"zone": "eu", "model": MODEL, "waiting": 1}]})]
        f.node.release.set()
        for lines in streams:
            async for _ in lines:
                pass
        assert (await asyncio.wait_for(third, 10)).status_code == 200
        await f.clock.advance_async(2.0)
        await eventually(lambda: len(cp.backlogs) == 2)
        assert cp.backlogs[-1] == ("edge-eu-1", {"pools": []})
        await f.clock.advance_async(4.0)
        assert len(cp.backlogs) == 2  # nothing waits: nothing more to say


async def test_a_request_past_its_queue_ttl_gets_503_queue_timeout_with_retry_after() -> None:
    async with one_slow_node() as f, contextlib.AsyncExitStack() as stack:
        streams = [await started_stream(f.http, stack, CHAT, EU) for _ in range(2)]
        client = openai.AsyncOpenAI(api_key=EU_KEY, base_url=f"{f.url}/v1", max_retries=0)
        late = asyncio.ensure_future(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-meridian-queue-ttl": "5"}))
        await eventually(lambda: f.waiting() == 1)
        await f.clock.advance_async(4.9)
        assert not late.done()
        await f.clock.advance_async(0.2)
        with pytest.raises(openai.APIStatusError) as caught:
            await asyncio.wait_for(late, 10)
        assert caught.value.status_code == 503 and caught.value.code == "queue_timeout"
        assert caught.value.response.headers["retry-after"] == "1"
        assert f.waiting() == 0 and f.node.hits == 2 and len(streams) == 2
        text = await f.metrics()
        assert metric(text, "meridian_router_flow_refused_total", zone="eu", band="0", tenant="eurobank",
                      reason="queue_timeout") == 1
        await client.close()


async def test_a_client_that_leaves_while_queued_is_never_sent() -> None:
    async with one_slow_node() as f, contextlib.AsyncExitStack() as stack:
        streams = [await started_stream(f.http, stack, CHAT, EU) for _ in range(2)]
        gone = asyncio.ensure_future(f.http.post("/v1/chat/completions", json=CHAT, headers=EU))
        await eventually(lambda: f.waiting() == 1)
        gone.cancel()  # the client hangs up
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await eventually(lambda: f.waiting() == 0)
        f.node.release.set()
        answer = await f.http.post("/v1/chat/completions", json=CHAT, headers=EU)
        assert answer.status_code == 200
        assert f.node.hits == 3 and len(streams) == 2  # the streams and this one: not the one that left


async def test_a_priority_above_the_keys_is_refused_and_a_lower_one_is_taken() -> None:
    async with one_slow_node() as f:
        f.node.release.set()
        above = await f.http.post("/v1/chat/completions", json=CHAT, headers=EU | {"x-meridian-priority": "3"})
        assert above.status_code == 400
        assert above.json()["error"]["type"] == "invalid_request_error"
        assert "x-meridian-priority" in above.json()["error"]["message"]
        garbled = await f.http.post("/v1/chat/completions", json=CHAT, headers=EU | {"x-meridian-queue-ttl": "soon"})
        assert garbled.status_code == 400
        below = await f.http.post("/v1/chat/completions", json=CHAT, headers=EU | {"x-meridian-priority": "-2"})
        assert below.status_code == 200
