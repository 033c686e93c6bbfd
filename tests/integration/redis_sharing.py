"""Helpers for the tests of router state shared through Redis: the sync interval they run
at, the routers' mirrors a test made (stopped when it ends), "seen by the other router
within about one interval", failed syncs driven on a ManualClock, a Redis that refuses
every connection, and a TCP proxy in front of Redis that a test opens and cuts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TypeVar

import httpx
import pytest
from router_harness import eventually, reserve_port

from geo_router.state.redis_sync import RedisMirror
from meridian.clock import ManualClock

M = TypeVar("M", bound=RedisMirror)

INTERVAL_S = 0.2
# "Within about one interval": A's push and B's pull each wait up to one, plus slack for a
# busy 2-core machine.
SEEN_WITHIN_S = 2 * INTERVAL_S + 0.3


class Mirrors:
    """The RedisMirrors (one per simulated router) a test made; its fixture stops them all."""

    def __init__(self) -> None:
        self._made: list[RedisMirror] = []

    def add(self, mirror: M) -> M:
        """`mirror`, to be stopped when the test ends (its caller starts or syncs it)."""
        self._made.append(mirror)
        return mirror

    async def start(self, mirror: M) -> M:
        """`mirror` started: it has synced once (when Redis answers) and keeps in sync."""
        await mirror.start()
        return self.add(mirror)

    async def stop_all(self) -> None:
        for mirror in self._made:
            await mirror.stop()


async def seen_within(condition: Callable[[], bool], limit_s: float = SEEN_WITHIN_S) -> float:
    """Seconds until `condition()` held; fails when that took longer than `limit_s`."""
    t0 = time.monotonic()
    await eventually(condition, timeout_s=limit_s + 2)
    elapsed = time.monotonic() - t0
    assert elapsed <= limit_s, f"took {elapsed:.2f}s"
    return elapsed


async def failed_syncs(clock: ManualClock, count: int) -> None:
    """Let a sync loop that cannot reach Redis fail `count` more times: it backs off on its
    clock, doubling from the interval (four failures take 3 s of the clock)."""
    delay = INTERVAL_S
    for _ in range(count):
        await eventually(lambda: clock.sleepers == 1)
        clock.advance(delay)
        delay *= 2
    await eventually(lambda: clock.sleepers == 1)


@contextmanager
def refused_redis() -> Iterator[str]:
    """The URL of a Redis that refuses every connection (its port bound, never listening)
    while the block runs."""
    closed = reserve_port()
    try:
        yield f"redis://127.0.0.1:{closed.getsockname()[1]}/0"
    finally:
        closed.close()


def unreachable_warnings(caplog: pytest.LogCaptureFixture) -> int:
    """How many times a mirror warned that Redis is unreachable."""
    return len([r for r in caplog.records if "Redis unreachable" in r.getMessage()])


class RedisProxy:
    """A TCP proxy to Redis on a port of its own: connections are refused until `open()`,
    forwarded while open, and dropped and refused again after `close()`."""

    def __init__(self, redis_url: str) -> None:
        self._target = httpx.URL(redis_url)
        self._sock = reserve_port()  # bound, not listening: connections are refused
        self.url = str(self._target.copy_with(host="127.0.0.1", port=self._sock.getsockname()[1]))
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._handle, sock=self._sock)

    async def close(self) -> None:
        """Stop listening (the port refuses from now on) and drop every connection."""
        if self._server is not None:
            self._server.close()
        self._sock.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> RedisProxy:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self._target.host, self._target.port or 6379)
        self._writers.extend((writer, up_writer))
        for task in (asyncio.create_task(_pump(reader, up_writer)), asyncio.create_task(_pump(up_reader, writer))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()
