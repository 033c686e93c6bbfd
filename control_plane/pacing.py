"""How the control plane's background loops wait: for a stop event, at most so long by the
app's clock.

Every loop (reaper, leader election, reconciler, autoscaler, routing long-polls) paces itself
with `wait_event` rather than `asyncio.wait_for(event.wait(), t)`, so the timeout runs on the
`Clock` the app carries: real time in production, a `ManualClock` that the test moves in
tests, which then check a backoff or a window without waiting it out.
"""

from __future__ import annotations

import asyncio

from meridian.clock import Clock


async def wait_event(event: asyncio.Event, clock: Clock, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` of `clock`'s time passed; whether it is set."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    sleeper = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        await asyncio.wait((waiter, sleeper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        sleeper.cancel()
    return event.is_set()
