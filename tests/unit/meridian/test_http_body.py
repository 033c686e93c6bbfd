"""The one request-body reader (meridian.http_body): bounded, and strict about
Content-Length, driven through ASGI messages as a server would send them."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from starlette.types import Message, Receive

from meridian.http_body import BadContentLength, BodyTooLarge, ClientGone, read_body

LIMIT = 100


def messages(*chunks: bytes, disconnect: bool = False) -> Receive:
    """A `receive` sending `chunks` as one body (then a disconnect, if asked, instead of
    the last chunk's end)."""
    queue: list[Message] = [
        {"type": "http.request", "body": c, "more_body": disconnect or i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    if disconnect:
        queue.append({"type": "http.disconnect"})
    sent: list[Message] = []

    async def receive() -> Message:
        if not queue:
            raise AssertionError(f"read past the body ({len(sent)} messages sent)")
        sent.append(queue.pop(0))
        return sent[-1]

    return receive


def refuses_before_reading() -> Receive:
    async def receive() -> Message:
        raise AssertionError("the body was read")

    return receive


@pytest.mark.parametrize(("chunks", "length"), [
    ([b'{"a": 1}'], "8"),
    ([b'{"a": ', b"1}"], "8"),
    ([b'{"a": ', b"1}"], None),
    ([b""], "0"),
    ([b""], None),
    ([b"x" * LIMIT], str(LIMIT)),
])
async def test_reads_a_body_whole(chunks: Iterable[bytes], length: str | None) -> None:
    chunks = list(chunks)
    assert await read_body(messages(*chunks), length, LIMIT) == b"".join(chunks)


@pytest.mark.parametrize("length", ["abc", "-1", "+5", " 5", "5 ", "1_0", "0x10", "²", ""])
async def test_a_malformed_content_length_is_refused_unread(length: str) -> None:
    with pytest.raises(BadContentLength, match="invalid Content-Length header"):
        await read_body(refuses_before_reading(), length, LIMIT)


async def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    with pytest.raises(BodyTooLarge, match=f"larger than {LIMIT} bytes") as err:
        await read_body(refuses_before_reading(), str(LIMIT + 1), LIMIT)
    assert err.value.limit == LIMIT
    with pytest.raises(BodyTooLarge):
        await read_body(refuses_before_reading(), "9" * 40, LIMIT)


async def test_a_body_growing_past_the_limit_is_refused_as_it_arrives() -> None:
    # Chunked (no length): refused at the chunk that crosses the limit, the rest unread.
    receive = messages(b"x" * 60, b"x" * 60, b"never read")
    with pytest.raises(BodyTooLarge):
        await read_body(receive, None, LIMIT)
    assert await receive() == {"type": "http.request", "body": b"never read", "more_body": False}


@pytest.mark.parametrize(("chunks", "length", "says"), [
    ([b"12345"], "3", "5 bytes or more, but its Content-Length header says 3"),
    ([b"12", b"345"], "4", "5 bytes or more, but its Content-Length header says 4"),
    ([b"12"], "5", "2 bytes, but its Content-Length header says 5"),
    ([b""], "5", "0 bytes, but its Content-Length header says 5"),
])
async def test_a_body_that_disagrees_with_its_content_length_is_refused(
    chunks: list[bytes], length: str, says: str
) -> None:
    with pytest.raises(BadContentLength, match=says):
        await read_body(messages(*chunks), length, LIMIT)


async def test_a_client_leaving_mid_body_is_client_gone() -> None:
    with pytest.raises(ClientGone):
        await read_body(messages(b"half", disconnect=True), "8", LIMIT)
