"""Routers on one Redis enforce a tenant's rate limits together: N routers admit about the limit,
not N times it; without Redis each router still enforces the limit on its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import pytest
from ratelimit_kit import admitted, tenant
from redis.asyncio import Redis
from redis_sharing import Mirrors, RedisProxy, refused_redis, unreachable_warnings
from router_harness import eventually

from geo_router.admission.ratelimit import RedisRateLimiter
from geo_router.errors import RateLimited

INTERVAL_S = 0.1

MakeLimiter = Callable[..., Awaitable[RedisRateLimiter]]


@pytest.fixture
def make_limiter(redis_url: str, prefix: str, mirrors: Mirrors) -> MakeLimiter:
    """RedisRateLimiters (one per simulated router) on this test's prefix; `started` runs the
    background sync, else the test calls sync_once() itself and so decides when routers sync."""

    async def make(url: str = redis_url, *, started: bool = False) -> RedisRateLimiter:
        limiter = mirrors.add(RedisRateLimiter(url, sync_interval_s=INTERVAL_S, timeout_s=0.5, key_prefix=prefix))
        if started:
            await limiter.start()
        else:
            await limiter.sync_once()
        return limiter

    return make


async def sync(*limiters: RedisRateLimiter) -> None:
    for limiter in limiters:
        assert await limiter.sync_once()


@pytest.mark.redis
async def test_two_routers_bursting_together_get_one_bucket_not_two(make_limiter: MakeLimiter):
    a, b = await make_limiter(), await make_limiter()
    await sync(a)  # both know the fleet has two routers
    t = tenant(rpm=60)  # a bucket of 60, refilling 1/s
    started = time.monotonic()
    total = 0
    for _ in range(6):  # six sync intervals of both hammering the idle tenant
        total += admitted(a, t) + admitted(b, t)
        await sync(a, b)
    refill = time.monotonic() - started + 1
    # Overshoot bound (RedisRateLimiter): what the other router admitted within one interval,
    # halved - a quarter of the bucket when both start at the same instant. Twice would be 120.
    assert 60 <= total <= 60 * 1.25 + refill


@pytest.mark.redis
async def test_a_tenant_busy_at_one_router_gets_the_whole_limit_there(make_limiter: MakeLimiter):
    a, b = await make_limiter(), await make_limiter()
    await sync(a)
    t = tenant(rpm=60)
    counts = [admitted(a, t)]
    for _ in range(3):
        await sync(a)
        counts.append(admitted(a, t))
    assert counts[0] == 30  # before its first sync: a provisional 1/fleet of a full bucket
    assert 59 <= sum(counts) <= 62  # within a few syncs, all of it
    await sync(b)
    assert admitted(b, t) <= 1  # and the other router knows it is spent


@pytest.mark.redis
async def test_routers_hammering_concurrently_stay_near_the_limit(make_limiter: MakeLimiter):
    routers = [await make_limiter(started=True) for _ in range(3)]
    await eventually(lambda: all(r.fleet_size == 3 for r in routers), timeout_s=5)
    t = tenant(rpm=600)  # a bucket of 600, refilling 10/s
    admitted = [0] * len(routers)

    async def hammer(i: int, until: float, deadline: float) -> None:
        # At least 1.5 s; longer (up to the deadline) while the fleet has not admitted the
        # bucket yet: on a loaded box the background syncs that hand each router its share of
        # what is left come late, and the bucket is spent later, never sooner.
        while (now := time.monotonic()) < until or (sum(admitted) < 600 and now < deadline):
            with contextlib.suppress(RateLimited):
                routers[i].admit(t, 0)
                admitted[i] += 1
            await asyncio.sleep(0.0005)

    started = time.monotonic()
    await asyncio.gather(*(hammer(i, started + 1.5, started + 10) for i in range(len(routers))))
    refill = 10 * (time.monotonic() - started + INTERVAL_S)
    # The cold-start bound (less than half a bucket beyond it) plus the refill; three routers
    # each on its own would admit 1800 and more.
    assert 600 <= sum(admitted) <= 600 * 1.5 + refill
    assert all(n > 0 for n in admitted)


@pytest.mark.redis
async def test_tokens_settled_at_one_router_count_at_the_other(make_limiter: MakeLimiter):
    a, b = await make_limiter(), await make_limiter()
    t = tenant(tpm=1000)
    admission = a.admit(t, 400)
    assert admission.headers["x-ratelimit-limit-tokens"] == "1000"
    a.settle(t, estimated=400, actual=900)
    b.admit(t, 0)
    await sync(a, b, a, b)
    assert admitted(b, t, 100) == 0  # the fleet's 100 left are shared by two routers
    assert 50 <= int(b.admit(t, 0).headers["x-ratelimit-remaining-tokens"]) <= 110


@pytest.mark.redis
async def test_every_key_has_a_ttl(make_limiter: MakeLimiter, redis: Redis, prefix: str):
    a = await make_limiter()
    a.admit(tenant(rpm=10, tpm=1000), 5)
    await sync(a)
    keys = [k async for k in redis.scan_iter(match=prefix + "*")]
    # Live routers, tenants with demand, the tenant's buckets and its routers with demand.
    assert len(keys) == 4
    for key in keys:
        assert 0 < await redis.pttl(key) <= (2 * 60 + 10) * 1000


async def test_without_redis_each_router_enforces_the_full_limit_itself(
    make_limiter: MakeLimiter, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, logger="geo_router.admission.ratelimit")
    with refused_redis() as url:
        limiter = await make_limiter(url)
        assert not limiter.redis_reachable
        t = tenant(rpm=5)
        assert admitted(limiter, t) == 5
        for _ in range(3):
            assert not await limiter.sync_once()
        assert admitted(limiter, t) == 0
        assert unreachable_warnings(caplog) == 1  # once per 30 s, not once per failed sync


@pytest.mark.redis
async def test_losing_redis_falls_back_to_local_limits_without_a_fresh_burst(
    make_limiter: MakeLimiter, redis_url: str
):
    async with RedisProxy(redis_url) as proxy:
        await proxy.open()
        limiter = await make_limiter(proxy.url)
        assert limiter.redis_reachable
        t = tenant(rpm=10)
        assert admitted(limiter, t, upto=6) == 6
        await proxy.close()
        assert not await limiter.sync_once()
        assert not limiter.redis_reachable
        assert admitted(limiter, t) == 4  # the local buckets were charged all along
