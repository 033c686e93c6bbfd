"""Wakes routing-table long-polls when the routing version moves, and releases them all
when the control plane shuts down (`close`): uvicorn waits for open requests before it
stops, and a long-poll held to its timeout (30 s) outlasted the graceful shutdown, which
then cancelled it with an ERROR and a traceback on every stop.

Waiters re-read the version (a bump by another process is not notified here) through one
shared read: a read begun since the last in-process bump and at most a quarter of
`recheck_s` ago answers every waiter, so 50 long-polling routers cost a few reads a second,
not 50."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meridian.clock import SYSTEM_CLOCK, Clock, event_or_timeout

# Another control-plane process on the same database cannot notify this one, so
# waiters also re-read the version this often.
DEFAULT_RECHECK_S = 1.0


class VersionWatch:
    """Long-poll support: in-process bumps wake waiters at once; others are seen on re-check."""

    def __init__(
        self,
        read_version: Callable[[], int],
        loop: asyncio.AbstractEventLoop,
        recheck_s: float = DEFAULT_RECHECK_S,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._read_version = read_version
        self._loop = loop
        self._recheck_s = recheck_s
        self._clock = clock
        self._changed = asyncio.Event()
        self._closing = False
        # The latest shared re-read: the event current when it began, when it began, its result.
        self._read: tuple[asyncio.Event, float, asyncio.Future[int]] | None = None
        self.reads = 0  # counted for tests

    def close(self) -> None:
        """Shutting down: every long-poll answers now (its current version), and new ones at once."""
        self._closing = True
        self._changed.set()

    def notify(self) -> None:
        """Tell waiters the version may have changed; safe to call from any thread."""
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def current(self) -> int:
        """The committed routing version, read off the event loop."""
        self.reads += 1
        return await asyncio.to_thread(self._read_version)

    async def _shared_read(self, changed: asyncio.Event) -> int:
        """The version, from a read begun after the bump that made `changed` current (so it
        sees that bump) and recently enough; else from a new read, which later callers share."""
        read = self._read
        now = self._clock.monotonic()
        if read is None or read[0] is not changed or now - read[1] > self._recheck_s / 4:
            read = self._read = (changed, now, asyncio.ensure_future(self.current()))
        # Shielded: one waiter giving up must not cancel the read the others wait for.
        return await asyncio.shield(read[2])

    async def wait_for_change(self, since: int, timeout_s: float) -> int:
        """Return the version once it differs from `since`, or the same one after `timeout_s`."""
        deadline = self._clock.monotonic() + timeout_s
        while True:
            # Take the event before reading, so a bump between the read and the wait
            # still wakes us.
            changed = self._changed
            version = await self._shared_read(changed)
            remaining = deadline - self._clock.monotonic()
            if version != since or remaining <= 0 or self._closing:
                return version
            await event_or_timeout(self._clock, changed, min(remaining, self._recheck_s))
