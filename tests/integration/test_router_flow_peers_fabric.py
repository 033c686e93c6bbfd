"""Two real routers on one Redis in front of one node with two batch slots, each with a stream
running there: the other router's stream counts, so each holds its next request (not the
node) until a stream ends, though the node's reports (no probes here) say nothing of it."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from fastapi import FastAPI
from router_harness import (
    EU_KEY,
    MODEL,
    NodeBehaviour,
    ServerGroup,
    eventually,
    make_table,
    node,
    node_app,
    router_settings,
    started_stream,
)

from geo_router import create_app
from geo_router.admission.flow_capacity import CACHE_S
from geo_router.state.table import StaticTableSource
from meridian.clock import ManualClock

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
EU = {"authorization": f"Bearer {EU_KEY}"}


async def _sync(*apps: FastAPI) -> None:
    """Each router publishes and reads; a pool's capacity as measured before is let go (it is
    kept CACHE_S on the router's clock, which only the test moves)."""
    for app in apps:
        assert await app.state.router.flow_peers.sync_once()
        app.state.router.clock.advance(CACHE_S)


@pytest.mark.redis
async def test_a_router_holds_its_request_while_another_routers_streams_fill_the_pool(
        redis_url: str, prefix: str) -> None:
    servers = ServerGroup()
    behaviour = NodeBehaviour("eu", mode="slow")
    try:
        table = make_table([node("eu", await servers.start(node_app(behaviour))).model_copy(
            update={"max_num_seqs": 2})])
        settings = router_settings(probe_enabled=False, flow_reserve_share=0.0, redis_url=redis_url,
                                   fleet_key_prefix=prefix)
        apps = [create_app(settings.model_copy(update={"router_id": name}), table_source=StaticTableSource(table),
                           clock=ManualClock()) for name in ("router-a", "router-b")]
        urls = [await servers.start(app) for app in apps]
        async with httpx.AsyncClient(base_url=urls[0], timeout=10) as a, \
                httpx.AsyncClient(base_url=urls[1], timeout=10) as b, contextlib.AsyncExitStack() as stack:
            streams = [await started_stream(b, stack, CHAT, EU)]
            await _sync(*apps)
            streams.append(await started_stream(a, stack, CHAT, EU))
            await _sync(*apps)  # each publishes its stream and reads the other's
            held = asyncio.ensure_future(b.post("/v1/chat/completions", json=CHAT, headers=EU))
            await eventually(lambda: sum(apps[1].state.router.flow.gauges().waiting.values()) == 1)
            assert behaviour.hits == 2  # held at router b, not queued at the node
            behaviour.release.set()
            for lines in streams:
                async for _ in lines:
                    pass
            await _sync(*apps)  # the streams have ended: b reads that a's did, and lets its request go
            answer = await asyncio.wait_for(held, 10)
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hi from eu"
    finally:
        behaviour.release.set()
        await servers.stop()
