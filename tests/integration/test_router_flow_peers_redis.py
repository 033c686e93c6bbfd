"""Routers on one Redis publish their requests running and waiting per flow-control pool, so
each counts the others' exactly and knows its share of the demand (Peers); a router that left
a pool, or stopped, takes its count back; a view no sync renewed lapses, and flow control goes
back to the nodes' reports."""

from __future__ import annotations

import itertools

import pytest
from redis.asyncio import Redis
from redis_sharing import Mirrors, RedisProxy

from geo_router.admission.flow_control import Peers
from geo_router.admission.flow_peers import PRESENCE_S, SharedFlowPeers
from meridian.clock import ManualClock

POOL = ("eu", "tiny")
_IDS = itertools.count()


def _router(url: str, prefix: str, mirrors: Mirrors, clock: ManualClock, name: str = "") -> SharedFlowPeers:
    return mirrors.add(SharedFlowPeers(url, key_prefix=prefix, timeout_s=0.5, sync_interval_s=0.1,
                                       router_id=name or f"router-{next(_IDS)}", clock=clock))


@pytest.mark.redis
async def test_routers_in_a_pool_see_each_others_requests_and_demand_and_one_that_left_stops_counting(
        redis_url: str, prefix: str, mirrors: Mirrors) -> None:
    clock = ManualClock()
    a, b = _router(redis_url, prefix, mirrors, clock), _router(redis_url, prefix, mirrors, clock)
    running_a, running_b, reads = {POOL: (5, 10)}, {POOL: (3, 2)}, []
    a.follow(lambda: dict(running_a), lambda: reads.append("a"))
    b.follow(lambda: dict(running_b), lambda: reads.append("b"))
    assert a.peers(POOL) is None  # nothing read yet: flow control goes by the nodes' reports
    for router in (a, b, a):
        assert await router.sync_once()
    assert a.peers(POOL) == Peers(others=3, others_demand=(5,), own_demand=15)
    assert b.peers(POOL) == Peers(others=5, others_demand=(15,), own_demand=5)
    assert reads == ["a", "b", "a"]  # flow control pumps after each read: room others made goes at once
    # b's requests end and nothing of its waits there: it takes its count back.
    running_b.clear()
    assert await b.sync_once()
    assert b.peers(POOL) is None
    assert await a.sync_once()
    assert a.peers(POOL) == Peers(others=0, others_demand=(), own_demand=15)
    # A view no sync has renewed within PRESENCE_S lapses.
    clock.advance(PRESENCE_S + 0.1)
    assert a.peers(POOL) is None


@pytest.mark.redis
async def test_a_stopping_router_takes_its_count_back_and_one_cut_off_falls_back(
        redis_url: str, prefix: str, mirrors: Mirrors, redis: Redis) -> None:
    clock = ManualClock()
    proxy = RedisProxy(redis_url)
    await proxy.open()
    a, b = _router(redis_url, prefix, mirrors, clock, "a"), _router(proxy.url, prefix, mirrors, clock, "b")
    a.follow(lambda: {POOL: (4, 0)}, lambda: None)
    b.follow(lambda: {POOL: (6, 1)}, lambda: None)
    try:
        for router in (a, b, a):
            assert await router.sync_once()
        assert a.peers(POOL) == Peers(others=6, others_demand=(7,), own_demand=4)
        await proxy.close()  # b is cut off: its view lapses (a drops b's field after PRESENCE_S of Redis's time)
        assert not await b.sync_once()
        clock.advance(PRESENCE_S + 0.1)
        assert b.peers(POOL) is None
    finally:
        await proxy.close()
    assert sorted(await redis.hkeys(f"{prefix}flow-routers:eu:tiny")) == [b"a", b"b"]
    await a.stop()  # a stops: its field goes at once, not after PRESENCE_S
    assert await redis.hkeys(f"{prefix}flow-routers:eu:tiny") == [b"b"]
