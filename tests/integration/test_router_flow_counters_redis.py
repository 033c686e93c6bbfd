"""Routers on one Redis share flow control's work counters: a tenant that spreads its requests
over two routers is charged once for all of it, so neither router orders it ahead of a tenant
that sent the same work through one; a router that cannot reach Redis orders by its own
counters and publishes them once Redis is back."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis_sharing import Mirrors, RedisProxy

from geo_router.admission.flow_counters import SharedWorkCounters
from geo_router.admission.flow_queue import Entry, FlowCaps, FlowQueue

POOL = ("eu", "tiny")
CAPS = FlowCaps(max_entries=100, max_bytes=1 << 20)


def _router(url: str, prefix: str, mirrors: Mirrors) -> SharedWorkCounters:
    return mirrors.add(SharedWorkCounters(url, key_prefix=prefix, timeout_s=0.5, sync_interval_s=0.1))


def _entry(tenant: str, work: float = 100) -> Entry[int]:
    return Entry(0, tenant, 0, work, 1, 1e9)


@pytest.mark.redis
async def test_work_served_through_two_routers_counts_once_on_each(redis_url: str, prefix: str,
                                                                   mirrors: Mirrors, redis: Redis) -> None:
    a, b = _router(redis_url, prefix, mirrors), _router(redis_url, prefix, mirrors)
    queue = FlowQueue(CAPS, a.for_pool(POOL))
    queue.push(_entry("spread"))
    queue.push(_entry("single"))
    # "spread" is served 600 tokens on each router meanwhile, "single" nothing.
    a.for_pool(POOL).charge("spread", 600)
    b.for_pool(POOL).charge("spread", 600)
    for router in (a, b, a):
        assert await router.sync_once()
    assert a.for_pool(POOL).level("spread") == pytest.approx(1200)
    assert b.for_pool(POOL).level("spread") == pytest.approx(1200)
    assert float(await redis.hget(f"{prefix}flow:eu:tiny", "spread")) == pytest.approx(1200)
    # Router a orders by the fleet's work: "single" goes first although "spread" came first.
    popped = queue.pop()
    assert popped is not None and popped.tenant == "single"


@pytest.mark.redis
async def test_a_router_cut_off_from_redis_keeps_its_charges_and_publishes_them_later(
        redis_url: str, prefix: str, mirrors: Mirrors) -> None:
    proxy = RedisProxy(redis_url)
    cut_off = _router(proxy.url, prefix, mirrors)
    other = _router(redis_url, prefix, mirrors)
    counters, theirs = cut_off.for_pool(POOL), other.for_pool(POOL)
    counters.charge("spread", 300)
    assert not await cut_off.sync_once()
    assert counters.level("spread") == 300  # ordering goes on with the local view
    await proxy.open()
    try:
        assert await cut_off.sync_once()
        assert await other.sync_once()
        assert theirs.level("spread") == pytest.approx(300)
        assert counters.level("spread") == pytest.approx(300)  # not counted twice
    finally:
        await proxy.close()


@pytest.mark.redis
async def test_a_returning_tenant_lifted_by_two_routers_at_once_starts_level_not_above(
        redis_url: str, prefix: str, mirrors: Mirrors, redis: Redis) -> None:
    a, b = _router(redis_url, prefix, mirrors), _router(redis_url, prefix, mirrors)
    ours, theirs = a.for_pool(POOL), b.for_pool(POOL)
    ours.charge("busy", 5000)  # served while "back" was away
    for router in (a, b):
        assert await router.sync_once()
    # "back" starts to wait on both routers within one sync interval: each lifts it to 5000.
    ours.lift("back", 5000)
    theirs.lift("back", 5000)
    ours.charge("back", 100)  # and router a lets one of its requests go
    for router in (a, b, a):
        assert await router.sync_once()
    # Level with "busy" plus what it was served: as a charge of the gap it was 10100.
    assert float(await redis.hget(f"{prefix}flow:eu:tiny", "back")) == pytest.approx(5100)
    assert ours.level("back") == pytest.approx(5100) and theirs.level("back") == pytest.approx(5100)
