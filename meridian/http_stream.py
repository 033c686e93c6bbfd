"""A streamed answer that learns of its client hanging up from meridian's own listeners.

Starlette's StreamingResponse watches for a hang-up with a second task waiting on
`receive()`, inside an anyio task group with its cancel scopes, for every stream: about
100 µs of a router's CPU per relayed stream (BENCHMARKS.md, stream_relay, issue 35's fourth
round). Meridian's listeners (meridian.http_server) already tell a request's app when its
client goes, through the scope's DISCONNECT_EXTENSION. `ListenerStreamingResponse`
registers there instead: the hang-up cancels the task sending the stream, which then ends as
Starlette's watch would end it (quietly, the body iterator closed). A cancel for any other
reason (the server stopping) is passed on. On another server (no extension in the scope) it
is Starlette's StreamingResponse, watch and all.

`HangUpWatch` is that mechanism alone, for any task serving a request: geo_router's
ClientWatch cancels a forward with it before the answer starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from meridian.http_server import DISCONNECT_EXTENSION

# How a front end says a client went: register(callback) calls callback() once it has (the
# listener's DISCONNECT_EXTENSION; a WebSocket's or gRPC call's Departure, which returns how
# to take the callback back).
HangUpRegister = Callable[[Callable[[], None]], Callable[[], None] | None]


class HangUpWatch:
    """Cancels the task that made it as soon as its client hangs up, until `stop()`: no task
    per request waiting to hear of it (geo_router's ClientWatch adds one for other servers)."""

    def __init__(self, register: HangUpRegister | None) -> None:
        self.fired = False
        self._active = True
        self._task = asyncio.current_task()
        self._unregister = register(self._fire) if register is not None else None

    def _fire(self) -> None:
        if self._active and self._task is not None and not self._task.done():
            self.fired = True
            self._task.cancel()

    def stop(self) -> None:
        self._active = False
        if self._unregister is not None:
            self._unregister()

    def ended_by_hang_up(self) -> bool:
        """After a CancelledError: True when the hang-up alone cancelled the task (that cancel
        is then taken back); False when something else (the server stopping) cancelled it too."""
        return self.fired and self._task is not None and self._task.uncancel() == 0


class ListenerStreamingResponse(StreamingResponse):
    """StreamingResponse, told of a hang-up by the listener rather than by a watching task."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        register = scope.get("extensions", {}).get(DISCONNECT_EXTENSION) if scope["type"] == "http" else None
        if register is None:
            await super().__call__(scope, receive, send)
            return
        await self._until_hang_up(register, send)
        if self.background is not None:
            await self.background()

    async def _until_hang_up(self, register: HangUpRegister, send: Send) -> None:
        watch = HangUpWatch(register)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not watch.ended_by_hang_up():
                raise
        finally:
            watch.stop()  # from here (an upstream being closed) a hang-up cancels nothing

