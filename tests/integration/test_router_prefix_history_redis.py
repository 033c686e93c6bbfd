"""Routers on one Redis share their routing history: where one router sent a prompt, the
others send the same conversation's next turn, as one router would."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from redis_sharing import INTERVAL_S, Mirrors, failed_syncs, refused_redis, seen_within, unreachable_warnings
from router_harness import eventually

from geo_router.state.prefix_history import RedisPrefixHistory
from meridian.clock import ManualClock

pytestmark = pytest.mark.redis

NODES = ["n1", "n2", "n3"]

MakeHistory = Callable[..., Awaitable[RedisPrefixHistory]]


@pytest.fixture
def make_history(redis_url: str, prefix: str, mirrors: Mirrors) -> MakeHistory:
    """Starts RedisPrefixHistories (one per simulated router) on this test's prefix."""

    async def make(url: str = redis_url, **kw: Any) -> RedisPrefixHistory:
        values: dict[str, Any] = {"ttl_s": 30.0, "max_keys": 10_000, "sync_interval_s": INTERVAL_S,
                                  "timeout_s": 0.5, "key_prefix": prefix}
        values.update(kw)
        return await mirrors.start(RedisPrefixHistory(url, **values))

    return make


async def test_a_prefix_routed_by_one_router_is_matched_at_another(make_history: MakeHistory):
    a, b = await make_history(), await make_history()
    a.record("n2", [11, 12, 13])
    assert a.match([11, 12, 13, 14], NODES) == {"n1": 0, "n2": 3, "n3": 0}
    await seen_within(lambda: b.match([11, 12, 13, 14], NODES) == {"n1": 0, "n2": 3, "n3": 0})
    # And back: B's next turn of the conversation extends what A knows.
    b.record("n2", [11, 12, 13, 14, 15])
    await seen_within(lambda: a.match([11, 12, 13, 14, 15], NODES)["n2"] == 5)
    # A node one router forgets (its cache is gone), the others forget too.
    b.forget_node("n2")
    await seen_within(lambda: a.match([11], NODES)["n2"] == 0)


async def test_a_router_that_starts_later_learns_the_recent_history(make_history: MakeHistory):
    a = await make_history()
    a.record("n1", [1, 2])
    a.record("n3", [1, 2, 3])
    assert await a.sync_once()
    late = await make_history()  # start() reads what is there before serving
    assert late.match([1, 2, 3], NODES) == {"n1": 2, "n2": 0, "n3": 3}


async def test_shared_records_expire_and_so_does_the_stream(
    make_history: MakeHistory, redis: Redis, prefix: str
):
    a, b = await make_history(ttl_s=1.0), await make_history(ttl_s=1.0)
    a.record("n1", [5, 6])
    await seen_within(lambda: b.match([5, 6], NODES)["n1"] == 2)
    stream = f"{prefix}prefix-history"
    assert 0 < await redis.pttl(stream) <= 1000
    await eventually(lambda: b.match([5, 6], NODES)["n1"] == 0, timeout_s=2.0)
    assert a.match([5, 6], NODES)["n1"] == 0

    async def gone() -> bool:
        return await redis.exists(stream) == 0

    for _ in range(200):  # Redis expires the stream in real time: poll it for real
        if await gone():
            break
        await asyncio.sleep(0.01)
    assert await gone()


async def test_the_stream_stays_bounded_and_repeats_are_not_republished(
    make_history: MakeHistory, redis: Redis, prefix: str
):
    a = await make_history(stream_maxlen=100)
    stream = f"{prefix}prefix-history"
    for _ in range(50):
        a.record("n1", list(range(200)))  # the same shared system prompt, request after request
    assert await a.sync_once()
    assert await redis.xlen(stream) == 1
    for i in range(400):  # a node per record: one entry each
        a.record(f"node-{i}", [i])
    assert await a.sync_once()
    # Approximate trimming (MAXLEN ~) cuts whole radix-tree nodes of 100 entries.
    assert await redis.xlen(stream) <= 200


async def test_without_redis_a_router_keeps_its_own_history(
    make_history: MakeHistory, caplog: pytest.LogCaptureFixture
):
    with refused_redis() as url:
        caplog.set_level(logging.WARNING, logger="geo_router.state.prefix_history")
        clock = ManualClock()
        history = await make_history(url=url, clock=clock)
        assert not history.redis_reachable
        history.record("n1", [1, 2, 3])
        await failed_syncs(clock, 4)
        assert history.match([1, 2, 3], NODES) == {"n1": 3, "n2": 0, "n3": 0}
        history.forget_node("n1")
        assert history.match([1, 2, 3], NODES)["n1"] == 0
        assert unreachable_warnings(caplog) == 1  # rate limited, not one per sync
