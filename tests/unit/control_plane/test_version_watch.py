"""Routing-table long-polls: woken by a version bump, answered at their timeout on the app's
clock, and all released at once when the control plane shuts down."""

from __future__ import annotations

import asyncio

from control_plane.version_watch import VersionWatch
from meridian.clock import ManualClock


async def asleep(clock: ManualClock, sleepers: int = 1) -> None:
    """Until `sleepers` waits are on the clock (the version is read in a thread first)."""
    for _ in range(500):
        if clock.sleepers >= sleepers:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{clock.sleepers} waits on the clock, not {sleepers}")


def watch(version: list[int], clock: ManualClock) -> VersionWatch:
    return VersionWatch(lambda: version[0], asyncio.get_running_loop(), recheck_s=1.0, clock=clock)


async def test_a_bump_wakes_a_waiter_and_the_timeout_answers_the_same_version() -> None:
    clock, version = ManualClock(), [3]
    w = watch(version, clock)
    waiter = asyncio.ensure_future(w.wait_for_change(3, 30))
    await asleep(clock)
    version[0] = 4
    w.notify()
    assert await asyncio.wait_for(waiter, 5) == 4
    timed = asyncio.ensure_future(w.wait_for_change(4, 2))
    for _ in range(2):  # re-checked every second until its 2 s are up
        assert not timed.done()
        await asleep(clock)
        clock.advance(1)
    assert await asyncio.wait_for(timed, 5) == 4


async def test_close_releases_every_long_poll_now_and_answers_new_ones_at_once() -> None:
    clock, version = ManualClock(), [7]
    w = watch(version, clock)
    waiters = [asyncio.ensure_future(w.wait_for_change(7, 30)) for _ in range(3)]
    await asleep(clock, 3)
    w.close()
    # No time passes: shutdown does not wait for the polls' timeouts.
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [7, 7, 7]
    assert await asyncio.wait_for(w.wait_for_change(7, 30), 5) == 7


async def test_waiters_share_their_version_reads_yet_each_sees_a_bump() -> None:
    clock, version = ManualClock(), [5]
    w = watch(version, clock)
    waiters = [asyncio.ensure_future(w.wait_for_change(5, 30)) for _ in range(20)]
    await asleep(clock, 20)
    assert w.reads == 1  # one read for all twenty
    for _ in range(3):  # each re-check: one read again, not twenty
        clock.advance(1)
        await asleep(clock, 20)
    assert w.reads == 4
    version[0] = 6
    w.notify()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [6] * 20
    # A bump by another process (no notify) is seen at the next re-check.
    late = asyncio.ensure_future(w.wait_for_change(6, 30))
    await asleep(clock)
    version[0] = 7
    clock.advance(1)
    assert await asyncio.wait_for(late, 5) == 7
