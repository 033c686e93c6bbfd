"""RedisSyncLoop: the background sync of the router states shared through Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from router_harness import eventually, reserve_port

from geo_router.state import redis_sync
from geo_router.state.redis_sync import RedisSyncLoop
from meridian.clock import Clock, ManualClock

TASK = "test-redis-sync"
LOG = logging.getLogger("tests.redis_sync_owner")
WHILE_DOWN = "the test state stays local to this router"
ONCE_BACK = "the test state is shared with the other routers"


class Owner:
    """A loop's owner: a sync that fails while `down` (Redis unreachable), and a final flush."""

    def __init__(self) -> None:
        self.down = False
        self.syncs = 0
        self.flushes = 0

    async def sync(self) -> None:
        self.syncs += 1
        if self.down:
            raise ConnectionError("Connection refused")

    async def flush(self) -> None:
        self.flushes += 1


MakeLoop = Callable[..., RedisSyncLoop]


@pytest.fixture
async def make_loop() -> AsyncIterator[MakeLoop]:
    """Makes loops with the test's texts and logger; stops them after the test."""
    made: list[RedisSyncLoop] = []

    def make(
        sync: Callable[[], Awaitable[None]],
        final_flush: Callable[[], Awaitable[None]] | None = None,
        interval_s: float = 10.0,
        clock: Clock | None = None,
    ) -> RedisSyncLoop:
        loop = RedisSyncLoop(
            sync,
            interval_s=interval_s,
            task_name=TASK,
            while_down=WHILE_DOWN,
            once_back=ONCE_BACK,
            log=LOG,
            final_flush=final_flush,
            clock=clock or ManualClock(),
        )
        made.append(loop)
        return loop

    yield make
    for loop in made:
        await loop.stop()


class RecordingClock(ManualClock):
    """A ManualClock that notes every sleep asked of it and lets it pass at once."""

    def __init__(self) -> None:
        super().__init__()
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)
        await super().sleep(0)


def running() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == TASK]


async def test_backoff_doubles_while_failing_up_to_the_max_and_resets_on_success(make_loop: MakeLoop) -> None:
    # The loop sleeps only while Redis is down: the delays it asks for are its backoff.
    clock = RecordingClock()
    slept = clock.slept
    syncs = 0

    async def sync() -> None:
        nonlocal syncs
        syncs += 1
        if syncs == 7:  # Redis is back, and a local change comes in meanwhile
            loop.wake()
            return
        raise ConnectionError("Connection refused")

    loop = make_loop(sync, interval_s=1.0, clock=clock)
    await loop.start()
    await eventually(lambda: len(slept) >= 8)
    await loop.stop()
    assert slept[:8] == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 2.0, 4.0]


async def test_warns_once_per_window_while_down_and_says_when_it_is_back(
    make_loop: MakeLoop, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)
    owner = Owner()
    clock = ManualClock()
    loop = make_loop(owner.sync, clock=clock)
    assert loop.reachable  # until a sync says otherwise

    def logged(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == LOG.name]

    owner.down = True
    for _ in range(3):
        assert not await loop.sync_once()
    assert not loop.reachable
    warning = f"Redis unreachable (ConnectionError: Connection refused); {WHILE_DOWN} until it is back"
    assert logged(logging.WARNING) == [warning]
    clock.advance(redis_sync._WARN_EVERY_S + 0.05)
    assert not await loop.sync_once()
    assert len(logged(logging.WARNING)) == 2  # still down a window later: said again

    owner.down = False
    assert await loop.sync_once() and loop.reachable
    assert await loop.sync_once()
    assert logged(logging.INFO) == [f"Redis is reachable again; {ONCE_BACK}"]
    # Down again: said at once, whatever the last warning's window.
    owner.down = True
    assert not await loop.sync_once()
    assert len(logged(logging.WARNING)) == 3


async def test_a_wake_syncs_at_once_and_otherwise_the_interval_holds(make_loop: MakeLoop) -> None:
    owner = Owner()
    clock = ManualClock()
    loop = make_loop(owner.sync, interval_s=10.0, clock=clock)
    await loop.start()
    assert owner.syncs == 1 and len(running()) == 1
    loop.wake()
    await eventually(lambda: owner.syncs == 2, timeout_s=2.0)
    await clock.advance_async(9.9)
    assert owner.syncs == 2  # no wake, no sync before the interval
    loop.wake()
    await eventually(lambda: owner.syncs == 3, timeout_s=2.0)


async def test_a_wake_while_redis_is_down_waits_for_the_backoff(make_loop: MakeLoop) -> None:
    owner = Owner()
    owner.down = True
    clock = ManualClock()
    loop = make_loop(owner.sync, interval_s=10.0, clock=clock)
    await loop.start()
    assert owner.syncs == 1 and not loop.reachable
    loop.wake()
    await clock.advance_async(9.9)
    assert owner.syncs == 1


async def test_stop_is_prompt_and_runs_the_final_flush_after_the_task_ended(make_loop: MakeLoop) -> None:
    owner = Owner()
    loop = make_loop(owner.sync, owner.flush, interval_s=10.0)
    await loop.start()
    await loop.start()  # a second start is a no-op
    assert owner.syncs == 1 and len(running()) == 1
    t0 = time.monotonic()
    await loop.stop()
    assert time.monotonic() - t0 < 1.0  # not a whole interval
    assert owner.flushes == 1 and not running()
    # Started again, it syncs again.
    await loop.start()
    assert owner.syncs == 2 and len(running()) == 1


async def test_stop_returns_even_when_the_sync_swallows_the_cancel(make_loop: MakeLoop) -> None:
    # What a cancel lost on 3.11 looks like to the loop: the sync in flight just returns.
    owner = Owner()
    in_flight = asyncio.Event()

    async def sync() -> None:
        owner.syncs += 1
        if owner.syncs == 2:
            in_flight.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()  # stuck until cancelled

    clock = ManualClock()
    loop = make_loop(sync, owner.flush, interval_s=0.01, clock=clock)
    await loop.start()
    await eventually(lambda: clock.sleepers == 1)
    clock.advance(0.01)
    async with asyncio.timeout(2):
        await in_flight.wait()
    t0 = time.monotonic()
    # Only a guard: stop() suppresses CancelledError, its cancel too, so the time is the check.
    async with asyncio.timeout(5):
        await loop.stop()
    assert time.monotonic() - t0 < 1.0
    assert owner.syncs == 2 and owner.flushes == 1 and not running()


async def test_stop_skips_the_flush_while_redis_is_down_and_survives_a_failing_one(
    make_loop: MakeLoop,
) -> None:
    owner = Owner()
    owner.down = True
    clock = ManualClock()
    loop = make_loop(owner.sync, owner.flush, interval_s=10.0, clock=clock)
    await loop.start()
    await eventually(lambda: clock.sleepers == 1)  # the task is in its backoff sleep now
    t0 = time.monotonic()
    await loop.stop()
    assert time.monotonic() - t0 < 1.0  # not the rest of the backoff
    assert owner.flushes == 0  # it would only wait for a timeout

    async def failing_flush() -> None:
        owner.flushes += 1
        raise ConnectionError("Connection reset by peer")

    owner.down = False
    loop = make_loop(owner.sync, failing_flush)
    await loop.start()
    await loop.stop()
    assert owner.flushes == 1 and not running()


def client(url: str) -> Redis:
    return Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))


@pytest.mark.redis
async def test_with_a_real_redis_it_syncs_and_flushes_at_stop(make_loop: MakeLoop, redis_url: str) -> None:
    key = f"meridian-test:{uuid.uuid4().hex}:redis-sync"
    redis = client(redis_url)
    try:

        synced_twice = asyncio.Event()

        async def sync() -> None:
            if await redis.incr(f"{key}:syncs") == 2:
                synced_twice.set()

        async def flush() -> None:
            await redis.set(f"{key}:flushed", "1")

        loop = make_loop(sync, flush, interval_s=10.0)
        await loop.start()
        assert loop.reachable and await redis.get(f"{key}:syncs") == b"1"
        loop.wake()
        await asyncio.wait_for(synced_twice.wait(), 2)
        assert await redis.get(f"{key}:syncs") == b"2"
        await loop.stop()
        assert await redis.get(f"{key}:flushed") == b"1"
    finally:
        await redis.delete(f"{key}:syncs", f"{key}:flushed")
        await redis.aclose()


async def test_with_redis_refusing_connections_it_goes_on_unreachable(
    make_loop: MakeLoop, caplog: pytest.LogCaptureFixture
) -> None:
    closed = reserve_port()  # bound, never listening: connections are refused
    redis = client(f"redis://127.0.0.1:{closed.getsockname()[1]}/0")
    flushes = 0

    async def flush() -> None:
        nonlocal flushes
        flushes += 1

    attempts = 0

    async def sync() -> None:
        nonlocal attempts
        attempts += 1
        await redis.ping()

    try:
        caplog.set_level(logging.WARNING, logger=LOG.name)
        clock = ManualClock()
        loop = make_loop(sync, flush, interval_s=0.05, clock=clock)
        await loop.start()  # does not raise
        assert not loop.reachable and len(running()) == 1
        for n in range(2, 6):  # several failed syncs, each after its backoff
            await eventually(lambda: clock.sleepers == 1)
            clock.advance(5.0)
            await eventually(lambda n=n: attempts >= n)
        assert len([r for r in caplog.records if "Redis unreachable" in r.getMessage()]) == 1
        await loop.stop()
        assert flushes == 0 and not running()
    finally:
        await redis.aclose()
        closed.close()
