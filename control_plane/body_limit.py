"""ASGI middleware that refuses request bodies over a size limit with a 413 problem."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.errors import problem_response


class BodyLimitMiddleware:
    """Rejects bodies over `max_bytes`, by Content-Length or by counting a streamed body.

    The body is read here, before the app sees it, because an error raised from inside
    FastAPI's body parsing would be turned into a 400. Admin bodies are small, so
    holding one (at most `max_bytes`) in memory costs nothing.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        buffered = await buffer_body(receive, self.max_bytes)
        if buffered is None:
            # The client left mid-body (or the listener cut it off): nobody reads an answer.
            return
        if body_size(buffered) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        await self.app(scope, replaying(buffered, receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem_response(413, f"request body exceeds the limit of {self.max_bytes} bytes")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


async def buffer_body(receive: Receive, limit: int) -> list[Message] | None:
    """The request's body messages, read until the body ends or passes `limit` bytes (the
    caller tells which by `body_size`); None when the client left mid-body."""
    buffered: list[Message] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        buffered.append(message)
        size += len(message.get("body", b""))
        if size > limit or not message.get("more_body", False):
            return buffered


def body_size(messages: list[Message]) -> int:
    return sum(len(m.get("body", b"")) for m in messages)


def replaying(messages: list[Message], receive: Receive) -> Receive:
    """A receive that hands out `messages` first, then reads on (an app downstream of a
    middleware that read the body reads it again)."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
