"""The background sync of router state shared through Redis, kept off the request path.

`connect_redis` makes the client every such owner uses; `RedisSyncLoop` runs its owner's
`sync` (push local changes, pull the other routers') every interval and at once after
`wake()`, backs off while Redis is unreachable, warns about that once per _WARN_EVERY_S and
says when Redis is back. The owner keeps serving from its local state meanwhile.

`RedisMirror` is the base of every such owner (fleet health, prefix history, rate limits):
one way to build the client and the loop, and one start / stop / sync_once / reachability,
so that the three differ only in what they push and pull. Time is the owner's `Clock`, so
a test moves intervals and backoffs with a ManualClock instead of waiting them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from meridian.clock import SYSTEM_CLOCK, Clock, event_or_timeout

# One warning per this many seconds while Redis stays unreachable.
_WARN_EVERY_S = 30.0
# While Redis is unreachable, retries back off up to this.
_MAX_RETRY_S = 5.0


def connect_redis(url: str, timeout_s: float, *, decode_responses: bool = False) -> Redis[Any]:
    """A client whose every call (connect and read) ends within `timeout_s`, with no retries
    inside redis-py: the sync loop is the retry, and it must not stall."""
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=decode_responses,
    )


class RedisSyncLoop:
    """Calls `sync` every `interval_s` (and at once after `wake()`) in a task of its own."""

    def __init__(
        self,
        sync: Callable[[], Awaitable[None]],
        *,
        interval_s: float,
        task_name: str,
        while_down: str,
        once_back: str,
        log: logging.Logger,
        final_flush: Callable[[], Awaitable[None]] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """`while_down` ends the warning ("... until it is back"), `once_back` the info that
        Redis is reachable again; `log` is the owner's, so its records keep their logger."""
        self._sync = sync
        self._interval_s = interval_s
        self._task_name = task_name
        self._while_down = while_down
        self._once_back = once_back
        self._log = log
        self._final_flush = final_flush
        self._clock = clock
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._down = False
        self._last_warning_at = -math.inf

    @property
    def reachable(self) -> bool:
        """False since the last sync failed, until one succeeds."""
        return not self._down

    def wake(self) -> None:
        """Sync now rather than at the next tick (unless Redis is down: then the backoff holds)."""
        self._wake.set()

    async def start(self) -> None:
        """Sync once (when Redis answers), then keep syncing in the background."""
        if self._task is not None:
            return
        self._stopping = False
        await self.sync_once()
        self._task = asyncio.create_task(self._run(), name=self._task_name)

    async def stop(self) -> None:
        """Stop syncing, then run the final flush if Redis was reachable (best effort)."""
        task, self._task = self._task, None
        if task is not None:
            # The flag too: a cancel landing as the loop wakes was seen lost on 3.11, and
            # then `await task` never returned.
            self._stopping = True
            self._wake.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._final_flush is not None and not self._down:
            # Stopping must not fail for a Redis that went away meanwhile.
            with contextlib.suppress(Exception):
                await self._final_flush()

    async def sync_once(self) -> bool:
        """Run `sync` now; False if it raised (Redis then counts as unreachable)."""
        try:
            await self._sync()
        except Exception as exc:  # noqa: BLE001 - whatever Redis does, the owner goes on locally
            self._note_unreachable(exc)
            return False
        if self._down:
            self._log.info("Redis is reachable again; %s", self._once_back)
            self._down = False
        return True

    async def _run(self) -> None:
        delay = self._interval_s
        while not self._stopping:
            if self._down:
                # Wakes come with every local change: heeding them would defeat the backoff.
                await self._clock.sleep(delay)
            else:
                # Until wake() or `delay` of the clock's time, whichever comes first.
                await event_or_timeout(self._clock, self._wake, delay)
            self._wake.clear()
            if self._stopping:
                return
            ok = await self.sync_once()
            delay = self._interval_s if ok else min(max(delay * 2, self._interval_s), _MAX_RETRY_S)

    def _note_unreachable(self, exc: Exception) -> None:
        now = self._clock.monotonic()
        if not self._down or now - self._last_warning_at >= _WARN_EVERY_S:
            self._log.warning(
                "Redis unreachable (%s: %s); %s until it is back", type(exc).__name__, exc, self._while_down
            )
            self._last_warning_at = now
        self._down = True


class RedisMirror:
    """Router state kept locally and mirrored through Redis by a background RedisSyncLoop.

    Subclasses name their sync task and what the warnings say (`task_name`, `while_down`,
    `once_back`, as RedisSyncLoop takes them) and implement `_push` (publish local changes)
    and `_pull` (merge the other routers'); `_sync` (one round, push then pull) and `_flush`
    (the last words at stop, by default a push) may be overridden. Reads and writes on the
    request path stay local.
    """

    task_name: str
    while_down: str
    once_back: str
    decode_responses: bool = False

    def __init__(
        self, redis_url: str, *, timeout_s: float, sync_interval_s: float, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._clock = clock
        self._redis = connect_redis(redis_url, timeout_s, decode_responses=self.decode_responses)
        # The subclass's logger, so that its records keep their name.
        log = logging.getLogger(type(self).__module__)
        self._sync_loop = RedisSyncLoop(
            self._sync,
            interval_s=sync_interval_s,
            task_name=self.task_name,
            while_down=self.while_down,
            once_back=self.once_back,
            log=log,
            final_flush=self._flush,
            clock=clock,
        )

    @property
    def redis_reachable(self) -> bool:
        """False since the last sync failed, until one succeeds."""
        return self._sync_loop.reachable

    async def start(self) -> None:
        """Learn the other routers' state (when Redis answers), then keep in sync."""
        await self._sync_loop.start()

    async def stop(self) -> None:
        """Stop syncing; hands over local changes not yet published (best effort)."""
        await self._sync_loop.stop()
        await self._redis.aclose()

    async def sync_once(self) -> bool:
        """Publish local changes, merge the other routers'; False if Redis failed."""
        return await self._sync_loop.sync_once()

    async def _sync(self) -> None:
        await self._push()
        await self._pull()

    async def _flush(self) -> None:
        await self._push()

    async def _push(self) -> None:
        raise NotImplementedError

    async def _pull(self) -> None:
        raise NotImplementedError
