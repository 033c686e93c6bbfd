"""The one clock: ManualClock moves only when told, wakes sleepers in deadline order, and
the waits time out on it, never on the event loop's clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from meridian.clock import SYSTEM_CLOCK, Clock, ManualClock, event_or_timeout, first_or_timeout, wait_at_most


def test_system_and_manual_clocks_are_clocks() -> None:
    assert isinstance(SYSTEM_CLOCK, Clock)
    assert isinstance(ManualClock(), Clock)
    assert SYSTEM_CLOCK.now().tzinfo is UTC


def test_monotonic_and_wall_time_move_together() -> None:
    clock = ManualClock(monotonic=5.0, wall=datetime(2026, 3, 1, tzinfo=UTC))
    clock.advance(90)
    assert clock.monotonic() == 95.0
    assert clock.now() == datetime(2026, 3, 1, 0, 1, 30, tzinfo=UTC)
    assert clock.time() == clock.now().timestamp()
    with pytest.raises(ValueError):
        clock.advance(-1)
    clock.set_wall(datetime(2025, 1, 1, tzinfo=UTC))  # a skewed wall clock; monotonic stays
    assert clock.monotonic() == 95.0 and clock.now().year == 2025


async def test_sleepers_wake_in_deadline_order_only_when_time_passes() -> None:
    clock = ManualClock()
    woke: list[str] = []

    async def nap(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [asyncio.create_task(nap("long", 10)), asyncio.create_task(nap("short", 2))]
    await clock.settled(2)
    await clock.advance_async(1.9)
    assert woke == []
    await clock.advance_async(0.1)
    assert woke == ["short"]
    await clock.advance_async(8)
    assert woke == ["short", "long"]
    await asyncio.gather(*tasks)


async def test_event_or_timeout_on_a_manual_clock() -> None:
    clock = ManualClock()
    event = asyncio.Event()
    waiting = asyncio.create_task(event_or_timeout(clock, event, 30))
    await clock.settled()
    assert not waiting.done()  # asleep until the clock moves
    await clock.advance_async(30)
    assert await waiting is False
    event.set()
    assert await event_or_timeout(clock, event, 30) is True


async def test_settled_says_when_nothing_sleeps() -> None:
    with pytest.raises(AssertionError, match="0 sleeps"):
        await ManualClock().settled(turns=3)


async def test_first_or_timeout_returns_what_finished() -> None:
    clock = ManualClock()
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(first_or_timeout(clock, 5, fut))
    await asyncio.sleep(0)
    fut.set_result(None)
    assert await waiting == {fut}
    assert clock.sleepers == 0  # the timer ended with the wait


async def test_wait_at_most_cancels_work_that_runs_out_of_time() -> None:
    clock = ManualClock()
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    waiting = asyncio.create_task(wait_at_most(clock, timedelta(seconds=3).total_seconds(), forever()))
    await started.wait()
    await clock.settled()
    await clock.advance_async(3)
    assert await waiting is False

    async def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await wait_at_most(clock, 3, fails())
