"""ASGI middleware that reads a request's body once, with the kernel's one reader
(meridian.http_body), before the app sees it.

The body is read here, before FastAPI's own parsing, because an error raised from inside it
would be turned into a 400 of FastAPI's making. So the control plane reads bodies as the
router and the node do: a Content-Length that is not a byte count, or that the body
contradicts, is a 400; a body over the limit, declared or counted, is a 413 with the
connection closed; each a problem+json body. Admin bodies are small, so holding one (at
most `max_bytes`) in memory costs nothing, and the app reads it again from memory.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.errors import problem_response
from meridian.http_body import BadContentLength, BodyTooLarge, ClientGone, read_body


class BodyLimitMiddleware:
    """Refuses bodies the kernel's reader refuses; replays the others to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await read_or_refuse(scope, receive, send, self.max_bytes)
        if body is not None:
            await self.app(scope, replaying(body, receive), send)


async def read_or_refuse(scope: Scope, receive: Receive, send: Send, limit: int) -> bytes | None:
    """The request's body, or None once it was refused with a problem (or the client left)."""
    try:
        return await read_body(receive, _content_length(scope), limit)
    except ClientGone:
        return None  # nobody reads an answer
    except BodyTooLarge:
        response = problem_response(413, f"request body exceeds the limit of {limit} bytes")
    except BadContentLength as exc:
        response = problem_response(400, str(exc))
    # What is left of the body is not read: the connection cannot carry another request.
    response.headers["connection"] = "close"
    await response(scope, receive, send)
    return None


def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the body already read, then reads on (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, object]:
        return pending.pop() if pending else await receive()

    return replay  # type: ignore[return-value]


def _content_length(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return bytes(value).decode("latin-1")
    return None
