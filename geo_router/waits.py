"""Waiting on a component's Clock for whichever comes first: something to happen, or time
to pass.

asyncio.wait_for and asyncio.wait(timeout=...) time out on the event loop's clock, which a
test cannot move. These wait on the component's `Clock` instead, so that a ManualClock
decides when a deadline, an interval or a backoff has passed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from meridian.clock import Clock


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
        return bool(await first_or_timeout(clock, seconds, woken))
    finally:
        woken.cancel()
