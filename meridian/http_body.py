"""The one reader of HTTP request bodies, for the router and the node: bounded, and strict
about Content-Length.

Contract of `read_body(receive, content_length, limit)`:

- a Content-Length that is not a plain decimal byte count ("abc", "-1", "+5", " 5") is
  `BadContentLength` (400), before anything is read: a header the app cannot trust is
  not guessed at or ignored;
- a declared length over `limit` is `BodyTooLarge` (413) at once, without reading the body;
- a body (declared or chunked) that grows past `limit` is `BodyTooLarge` as soon as it
  does: at most `limit` bytes plus one message are ever buffered;
- a body whose size disagrees with its Content-Length (one that lies) is
  `BadContentLength` (400): a request is never served from bytes its framing does not
  account for;
- a client that leaves mid-body is `ClientGone` (nobody reads the answer: 499).

Why one: the router ignored a malformed Content-Length while the node refused it, so the
same request read differently depending on which part answered. Each app maps these
errors, which are the kernel's, to its own OpenAI error where it maps every other one.

The ASGI messages are read directly (not Starlette's `Request.stream()`): a chat request is
nearly always one message, returned as it is, and this runs for every request.
"""

from __future__ import annotations

from starlette.types import Receive


class BodyError(Exception):
    """A request body that cannot be read as asked; the message says why."""


class BadContentLength(BodyError):
    """The Content-Length header is malformed, or the body's size disagrees with it (400)."""


class BodyTooLarge(BodyError):
    """The body is (or declares itself) larger than the limit (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than {limit} bytes")
        self.limit = limit


class ClientGone(BodyError):
    """The client disconnected before its body was read whole (499)."""

    def __init__(self) -> None:
        super().__init__("the client disconnected while sending the request body")


def declared_length(content_length: str | None, limit: int) -> int | None:
    """The byte count a Content-Length header declares (None: no header); BadContentLength
    when it is not a plain decimal number, BodyTooLarge when it exceeds `limit`."""
    if content_length is None:
        return None
    # isdigit() alone admits non-ASCII digits ("²") that int() refuses; int() alone admits
    # signs, spaces and underscores that no HTTP framing does.
    if not (content_length.isascii() and content_length.isdigit()):
        raise BadContentLength(f"invalid Content-Length header {content_length[:40]!r}: not a byte count")
    declared = int(content_length)
    if declared > limit:
        raise BodyTooLarge(limit)
    return declared


def _lying(size: int, declared: int) -> BadContentLength:
    return BadContentLength(f"request body is {size} bytes or more, but its Content-Length header says {declared}")


async def read_body(receive: Receive, content_length: str | None, limit: int) -> bytes:
    """The whole request body, read from the ASGI `receive` (see the module's contract)."""
    declared = declared_length(content_length, limit)
    expected = limit if declared is None else declared
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > expected:
            # Stop at once either way: past the limit, or past what the header declared.
            raise BodyTooLarge(limit) if declared is None or size > limit else _lying(size, declared)
        if not message.get("more_body", False):
            if declared is not None and size != declared:
                raise BadContentLength(
                    f"request body is {size} bytes, but its Content-Length header says {declared}"
                )
            if not chunks:
                return chunk
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)
