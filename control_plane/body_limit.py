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
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client left mid-body (or the listener cut it off): nobody reads an answer.
                return
            buffered.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem_response(413, f"request body exceeds the limit of {self.max_bytes} bytes")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
