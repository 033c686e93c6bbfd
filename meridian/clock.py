"""One clock for the whole fabric: monotonic time for intervals, wall time for records,
and sleeping, behind one small protocol that each app carries in its context.

Why one: timeouts, backoffs, windows and leases are the behaviour most worth testing and
the slowest to test on real time. Every component takes a `Clock` (default
`SYSTEM_CLOCK`); tests pass a `ManualClock` and move time with `advance()`, so a 30 s
backoff or a one-minute rate window is checked in microseconds and without flakiness.

`ManualClock.sleep` does not return until the clock has been advanced past its deadline,
so a loop that backs off with `await clock.sleep(d)` waits for the test to move time.

`asyncio.wait_for` and `asyncio.wait(timeout=...)` time out on the event loop's clock,
which a test cannot move; `first_or_timeout`, `event_or_timeout` and `wait_at_most` wait
on a `Clock` instead, so every loop's interval, deadline and backoff is the app's time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """Time as a component sees it."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for intervals and deadlines)."""
        ...

    def now(self) -> datetime:
        """The wall-clock time, timezone-aware UTC (for records, leases, expiry)."""
        ...

    def time(self) -> float:
        """The wall-clock time as seconds since the epoch."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told to (tests).

    Monotonic and wall time advance together. Sleepers wake, in deadline order, when
    `advance` (or `advance_async`) moves the clock past their deadline; a sleep of zero or
    less returns at once, as asyncio.sleep(0) does, after yielding to the loop.
    """

    def __init__(self, *, monotonic: float = 1000.0, wall: datetime | None = None) -> None:
        self._mono = monotonic
        self._wall = wall or datetime(2026, 1, 1, tzinfo=UTC)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self._mono

    def now(self) -> datetime:
        return self._wall

    def time(self) -> float:
        return self._wall.timestamp()

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._mono + seconds, next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> int:
        """How many sleeps are waiting for time to move."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def settled(self, sleepers: int = 1, *, turns: int = 1000) -> None:
        """Let the loop run until at least `sleepers` sleeps wait on this clock. A task that
        is about to sleep must be asleep before time moves, or it sleeps from the new time."""
        for _ in range(turns):
            if self.sleepers >= sleepers:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{self.sleepers} sleeps wait on the clock, not {sleepers}")

    def advance(self, seconds: float) -> None:
        """Move time forward and wake the sleepers whose deadline has come."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._mono += seconds
        self._wall += timedelta(seconds=seconds)
        while self._sleepers and self._sleepers[0][0] <= self._mono:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def advance_async(self, seconds: float, *, settle: int = 5) -> None:
        """`advance`, then let the woken tasks run (`settle` turns of the loop)."""
        self.advance(seconds)
        for _ in range(settle):
            await asyncio.sleep(0)

    def set_wall(self, wall: datetime) -> None:
        """Jump the wall clock alone (a skewed or corrected system clock)."""
        self._wall = wall


async def first_or_timeout(clock: Clock, seconds: float, *futures: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
    """Until one of `futures` is done or `seconds` of the clock's time pass.

    Returns the futures that are done (empty when the time passed first); none of them is
    cancelled. Not asyncio.wait_for: on 3.11 it swallows a cancel that comes as the awaited
    thing finishes. A cancel of the caller propagates out of asyncio.wait, and the timer ends.
    """
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        done, _ = await asyncio.wait({timer, *futures}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
    done.discard(timer)
    return done


async def event_or_timeout(clock: Clock, event: asyncio.Event, seconds: float) -> bool:
    """Until `event` is set or `seconds` of the clock's time pass; True when it was set."""
    if event.is_set():
        return True  # no wait, and no timer to start
    woken = asyncio.ensure_future(event.wait())
    try:
        await first_or_timeout(clock, seconds, woken)
    finally:
        woken.cancel()
    return event.is_set()


async def wait_at_most(clock: Clock, seconds: float, work: Awaitable[object]) -> bool:
    """Wait for `work` for at most `seconds` of `clock`'s time: True if it finished (its
    result is dropped, its error raised), False if the time ran out first (it is cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        await first_or_timeout(clock, seconds, task)
    finally:
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        task.result()
        return True
    return False
