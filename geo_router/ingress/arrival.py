"""A request as the pipeline reads it, whichever front end received it.

The pipeline (geo_router.app's `_route`) needs four things of a request: its headers (the
key, the idempotency key, trace context, where the client is), the peer's address, its body
read within the size limit (after the key is checked: a bad key costs no body read), and
word of the client leaving (ClientWatch cancels a forward; a scale-from-zero hold stops
waiting). An `Arrival` gives exactly these.

- `HttpArrival`: an HTTP request, from its ASGI request.
- `CallArrival`: a WebSocket turn or a gRPC call. The front end holds the body and the
  caller's headers already, and a `Departure` says when its client goes. Nothing is dressed
  up as an ASGI request: no scope, no `receive`, no second read of a body already in hand.

The pipeline writes the request's id into the arrival (`named`), so that a front end that
answers an error itself names the request as the logs do.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from starlette.datastructures import Headers
from starlette.requests import Request

from meridian.http_server import DISCONNECT_EXTENSION

from ..errors import RequestTooLarge
from .request import ClientWatch, read_body, until_disconnected


class Arrival(Protocol):
    """What the pipeline reads of a request."""

    @property
    def headers(self) -> Headers: ...

    @property
    def peer(self) -> str | None: ...

    async def body(self, limit: int) -> bytes:
        """The whole body; RequestTooLarge past `limit` bytes (BadRequest, ClientClosedRequest)."""

    def watch(self) -> ClientWatch:
        """A watch that cancels the calling task when the client leaves."""

    async def departed(self) -> None:
        """Returns once the client has left."""

    def named(self, request_id: str) -> None:
        """The id the pipeline gave the request."""


@dataclass(slots=True)
class HttpArrival:
    """An HTTP request (its id lands in `request.state`, where the app's error handler reads it)."""

    request: Request

    @property
    def headers(self) -> Headers:
        return self.request.headers

    @property
    def peer(self) -> str | None:
        client = self.request.client
        return client.host if client else None

    async def body(self, limit: int) -> bytes:
        return await read_body(self.request, limit)

    def watch(self) -> ClientWatch:
        scope = self.request.scope
        return ClientWatch(scope.get("extensions", {}).get(DISCONNECT_EXTENSION), self.request.receive)

    async def departed(self) -> None:
        await until_disconnected(self.request.receive)

    def named(self, request_id: str) -> None:
        self.request.state.request_id = request_id


@dataclass
class Departure:
    """Whether the outer client has gone, and who to tell when it goes.

    One lasts as long as its connection (a WebSocket's many turns): a callback is taken
    back (the function `register` returns) once its turn is over, so none pile up."""

    gone: asyncio.Event = field(default_factory=asyncio.Event)
    _callbacks: dict[int, Callable[[], None]] = field(default_factory=dict)
    _next: int = 0

    def register(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the client goes (now, if it has); returns its unregistration."""
        if self.gone.is_set():
            callback()
            return _nothing
        key = self._next = self._next + 1
        self._callbacks[key] = callback
        return functools.partial(self._callbacks.pop, key, None)

    def left(self) -> None:
        if self.gone.is_set():
            return
        self.gone.set()
        callbacks, self._callbacks = self._callbacks, {}
        for callback in callbacks.values():
            callback()


def _nothing() -> None:
    pass


@dataclass(slots=True)
class CallArrival:
    """A WebSocket turn or a gRPC call: its body and headers in hand (names lower-case)."""

    raw_headers: list[tuple[bytes, bytes]]
    payload: bytes
    peer: str | None
    departure: Departure
    request_id: str | None = None
    _headers: Headers | None = None

    @property
    def headers(self) -> Headers:
        if self._headers is None:
            self._headers = Headers(raw=self.raw_headers)
        return self._headers

    async def body(self, limit: int) -> bytes:
        if len(self.payload) > limit:
            raise RequestTooLarge(limit)
        return self.payload

    def watch(self) -> ClientWatch:
        return ClientWatch(self.departure.register, None)

    async def departed(self) -> None:
        await self.departure.gone.wait()

    def named(self, request_id: str) -> None:
        self.request_id = request_id
