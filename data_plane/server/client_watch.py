"""Waiting on a request's work while watching whether its client is still there.

A whole (non-streamed) answer is only sent once it is complete, so nothing else notices a
client that hung up meanwhile: the engine (or vLLM behind the node) would go on generating
for nobody. The work runs as a task and the client is polled between waits; once it is
gone the task is cancelled, which aborts the generation (an engine request's iterator is
closed, or vLLM's connection, which makes vLLM abort).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from data_plane.server.errors import ClientClosedError

T = TypeVar("T")
# How often the client is checked while the work goes on.
POLL_S = 0.25


async def unless_disconnected(
    request: Request, work: Awaitable[T], *, discard: Callable[[T], Awaitable[None]] | None = None
) -> T:
    """`work`'s result, or ClientClosedError (`work` cancelled) once the client has hung up.

    `discard` releases a result that arrived just as the client left (an open response).
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                if discard is not None and task.done() and not task.cancelled() and task.exception() is None:
                    await discard(task.result())
                raise ClientClosedError()
    finally:
        if not task.done():
            task.cancel()
            # The caller leaves with its own error: how the cancelled work ended is moot.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
