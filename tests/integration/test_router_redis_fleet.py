"""Routers on one Redis share node health: a node one router ejected, the others skip."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

# The router tests' stand-in nodes and uvicorn runner are shared, not copied.
from redis_sharing import (
    INTERVAL_S,
    Mirrors,
    RedisProxy,
    failed_syncs,
    refused_redis,
    seen_within,
    unreachable_warnings,
)
from router_harness import (
    GLOBAL_KEY,
    MODEL,
    NodeBehaviour,
    ServerGroup,
    eventually,
    make_table,
    node,
    node_app,
    router_settings,
)

from geo_router import create_app
from geo_router.state.health import Ejection, EjectionPolicy, FailureKind
from geo_router.state.redis_fleet import RedisFleetState
from geo_router.state.table import StaticTableSource
from meridian.clock import ManualClock
from meridian.contracts import HEADER_NODE

pytestmark = pytest.mark.redis

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

MakeFleet = Callable[..., Awaitable[RedisFleetState]]


@pytest.fixture
def make_fleet(redis_url: str, prefix: str, mirrors: Mirrors) -> MakeFleet:
    """Starts RedisFleetStates (one per simulated router) on this test's prefix."""

    async def make(url: str = redis_url, base_s: float = 5.0, consecutive_failures_to_eject: int = 5,
                   max_ejected_percent: float = 50.0, **kwargs: Any) -> RedisFleetState:
        policy = EjectionPolicy(base_s, 60.0, consecutive_failures_to_eject, max_ejected_percent)
        return await mirrors.start(RedisFleetState(url, policy=policy, sync_interval_s=INTERVAL_S, timeout_s=0.5,
                                                   key_prefix=prefix, **kwargs))

    return make


async def test_a_node_ejected_by_one_router_is_skipped_by_another(make_fleet: MakeFleet):
    a, b = await make_fleet(), await make_fleet()
    assert a.record_failure("node-x") == 5.0
    await seen_within(lambda: b.is_ejected("node-x"))
    assert 3.0 < b.ejected_for_s("node-x") <= 5.0
    assert not b.is_ejected("node-y")
    # B's requests that were already on their way fail too: no new evidence, no longer ejection.
    assert b.record_failure("node-x") == 0.0
    assert b.ejected_for_s("node-x") <= 5.0


async def test_the_backoff_level_is_shared(make_fleet: MakeFleet):
    a, b = await make_fleet(base_s=1.0), await make_fleet(base_s=1.0)
    a.record_failure("node-x")
    await seen_within(lambda: b.is_ejected("node-x"))
    await eventually(lambda: not b.is_ejected("node-x"))
    # B ejects it next: its second ejection since it last answered, so twice as long.
    assert b.record_failure("node-x") == 2.0
    await seen_within(lambda: a.ejected_for_s("node-x") > 1.0)


async def test_a_success_at_one_router_clears_the_ejection_everywhere(
    make_fleet: MakeFleet, redis: Redis, prefix: str
):
    a, b = await make_fleet(), await make_fleet()
    a.record_failure("node-x")
    await seen_within(lambda: b.is_ejected("node-x"))
    a.record_success("node-x")
    assert not a.is_ejected("node-x")
    await seen_within(lambda: not b.is_ejected("node-x"))
    assert await redis.exists(f"{prefix}ejected:node-x") == 0
    # And the other way round: the router that ejected it hears of B's success.
    a.record_failure("node-x")
    await seen_within(lambda: b.is_ejected("node-x"))
    b.record_success("node-x")
    await seen_within(lambda: not a.is_ejected("node-x"))
    assert a.record_failure("node-x") == 5.0  # forgiven: the backoff starts over


async def test_an_early_return_at_one_router_returns_the_node_everywhere(
    make_fleet: MakeFleet, redis: Redis, prefix: str
):
    a, b = await make_fleet(), await make_fleet()
    a.record_failure("node-x")
    await seen_within(lambda: b.is_ejected("node-x"))
    assert b.uneject("node-x")  # B's probes see the node answer again
    await seen_within(lambda: not a.is_ejected("node-x"))
    assert await redis.exists(f"{prefix}ejected:node-x") == 0
    # An early return is not forgiveness: the next ejection is longer.
    assert b.record_failure("node-x") == 10.0
    await seen_within(lambda: a.is_ejected("node-x"))


async def test_errors_below_the_threshold_are_counted_per_router(make_fleet: MakeFleet):
    a = await make_fleet(consecutive_failures_to_eject=3)
    b = await make_fleet(consecutive_failures_to_eject=3)
    for fleet in (a, b, a, b):
        assert fleet.record_failure("node-x", FailureKind.ERROR) == 0.0
    # Syncs happen: nothing of this is shared.
    assert await a.sync_once() and await b.sync_once()
    assert not a.is_ejected("node-x") and not b.is_ejected("node-x")
    assert a.record_failure("node-x", FailureKind.ERROR) == 5.0
    await seen_within(lambda: b.is_ejected("node-x"))


async def test_the_max_ejected_percent_counts_other_routers_ejections(make_fleet: MakeFleet):
    a = await make_fleet(max_ejected_percent=50)
    b = await make_fleet(max_ejected_percent=50)
    events: list[Ejection] = []
    b.add_ejection_listener(events.append)
    for fleet in (a, b):
        fleet.set_known_nodes(["n1", "n2", "n3", "n4"])
    a.record_failure("n1")
    a.record_failure("n2")
    await seen_within(lambda: b.is_ejected("n1") and b.is_ejected("n2"))
    assert b.record_failure("n3") == 0.0
    assert not b.is_ejected("n3")
    assert events == [Ejection("n3", FailureKind.UNREACHABLE, 0.0, enforced=False)]


async def test_an_ejection_expires_by_itself(make_fleet: MakeFleet, redis: Redis, prefix: str):
    a, b = await make_fleet(base_s=0.6), await make_fleet(base_s=0.6)
    a.record_failure("node-x")
    key = f"{prefix}ejected:node-x"
    await seen_within(lambda: b.is_ejected("node-x"))
    assert 0 < await redis.pttl(key) <= 600
    # Redis counts the key's TTL in real time, so this waits for real: just past the ejection.
    await asyncio.sleep(0.7)
    assert not a.is_ejected("node-x") and not b.is_ejected("node-x")
    assert await redis.exists(key) == 0
    # Expiry is not forgiveness: the next failure ejects for longer, as with one router.
    assert a.record_failure("node-x") == pytest.approx(1.2)


async def test_an_ejection_written_by_an_older_router_is_understood(
    make_fleet: MakeFleet, redis: Redis, prefix: str
):
    b = await make_fleet(base_s=1.0)
    until = time.time() + 0.6
    # Routers before the error threshold stored the backoff level as "failures".
    await redis.set(f"{prefix}ejected:node-x", json.dumps({"ejected_until": until, "failures": 2}), px=600)
    await redis.zadd(f"{prefix}ejected", {"node-x": until})
    await seen_within(lambda: b.is_ejected("node-x"))
    await eventually(lambda: not b.is_ejected("node-x"))
    assert b.record_failure("node-x") == 4.0  # the third ejection


async def test_without_redis_each_router_still_ejects_on_its_own(
    make_fleet: MakeFleet, caplog: pytest.LogCaptureFixture
):
    with refused_redis() as url:
        caplog.set_level(logging.WARNING, logger="geo_router.state.redis_fleet")
        clock = ManualClock()
        fleet = await make_fleet(url=url, clock=clock)
        assert not fleet.redis_reachable
        assert fleet.record_failure("node-x") == 5.0
        assert fleet.is_ejected("node-x") and not fleet.is_ejected("node-y")
        fleet.begin("node-y")
        assert fleet.in_flight("node-y") == 1
        await failed_syncs(clock, 4)
        assert fleet.is_ejected("node-x")
        fleet.record_success("node-x")
        assert not fleet.is_ejected("node-x")
        assert unreachable_warnings(caplog) == 1  # rate limited, not one per sync


async def test_a_router_shares_its_ejections_once_redis_is_back(
    make_fleet: MakeFleet, redis_url: str
):
    async with RedisProxy(redis_url) as proxy:
        a = await make_fleet(url=proxy.url)
        b = await make_fleet()
        a.record_failure("node-x")
        await a.sync_once()  # fails: the proxy refuses
        await b.sync_once()
        assert not a.redis_reachable and not b.is_ejected("node-x")
        await proxy.open()
        # A backs off while Redis is down (0.4 s, 0.8 s, ...), so allow a few intervals.
        await seen_within(lambda: b.is_ejected("node-x"), limit_s=3.0)
        assert a.redis_reachable


async def test_a_router_skips_a_node_another_router_saw_fail(redis_url: str, prefix: str):
    servers = ServerGroup()
    clients: list[httpx.AsyncClient] = []
    try:
        behaviours = {name: NodeBehaviour(name) for name in ("us", "eu")}
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        table = make_table([node(name, url) for name, url in urls.items()])
        # One 500 ejects here, whatever the default threshold (this test is about sharing).
        settings = router_settings(redis_url=redis_url, fleet_key_prefix=prefix,
                                   fleet_sync_interval_s=INTERVAL_S, consecutive_failures_to_eject=1)
        apps = [create_app(settings, table_source=StaticTableSource(table)) for _ in range(2)]
        for app in apps:
            assert isinstance(app.state.router.fleet, RedisFleetState)
        router_a, router_b = [await servers.start(app) for app in apps]
        for url in (router_a, router_b):
            clients.append(httpx.AsyncClient(base_url=url, timeout=10,
                                             headers={"authorization": f"Bearer {GLOBAL_KEY}"}))
        client_a, client_b = clients

        behaviours["us"].mode = "error500"  # the nearest node starts failing
        r = await client_a.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "eu-1"
        assert behaviours["us"].hits == 1

        fleet_b = apps[1].state.router.fleet
        await seen_within(lambda: fleet_b.is_ejected("us-1"))
        r = await client_b.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "eu-1"
        assert behaviours["us"].hits == 1  # B never tried the failing node
        assert behaviours["eu"].hits == 2
    finally:
        for c in clients:
            await c.aclose()
        await servers.stop()


# --- a TCP proxy in front of Redis that can be switched on later --------------------------
