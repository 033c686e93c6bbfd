"""Waiting on the node's `Clock` (meridian.clock) rather than on the event loop's time.

The node app and its agent carry one Clock (SYSTEM_CLOCK unless a test passes a
ManualClock), so that a heartbeat interval, a retry backoff or a drain timeout is waited
out on that clock, and a test moves it instead of sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from meridian.clock import Clock


async def wait_at_most(clock: Clock, seconds: float, work: Awaitable[object]) -> bool:
    """Wait for `work` for at most `seconds` of `clock`'s time: True if it finished (its
    result is dropped, its error raised), False if the time ran out first (it is cancelled)."""
    task = asyncio.ensure_future(work)
    nap = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({task, nap}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        nap.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        task.result()
        return True
    return False
