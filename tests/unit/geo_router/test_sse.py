"""SSEFramer: a node's stream is passed on a run of whole events at a time, whatever the
separator (LF or CRLF) and wherever the node's chunks cut it."""

from __future__ import annotations

import pytest

from geo_router.sse import SSEFramer

_LF = b'data: {"a":1}\n\ndata: {"b":2}\n\n'
_CRLF = b'data: {"a":1}\r\n\r\ndata: {"b":2}\r\n\r\n'
_MIXED = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\ndata: {"c":3}\n\n'


@pytest.mark.parametrize("stream", [_LF, _CRLF, _MIXED], ids=["lf", "crlf", "mixed"])
def test_every_cut_of_a_stream_releases_whole_events_only_and_all_of_them(stream: bytes) -> None:
    for cut in range(len(stream) + 1):
        framer = SSEFramer(is_sse=True)
        first = framer.feed(stream[:cut])
        # What is released ends an event; what is held is the start of the next one.
        assert first == b"" or first.endswith((b"\n\n", b"\r\n\r\n")), cut
        assert stream.startswith(first)
        assert first + framer.feed(stream[cut:]) == stream, cut
        assert framer.flush() == b""


def test_a_crlf_separator_cut_after_its_last_cr_is_found_when_the_lf_comes() -> None:
    framer = SSEFramer(is_sse=True)
    assert framer.feed(b'data: {"a":1}\r\n\r') == b""
    assert framer.feed(b"\n") == b'data: {"a":1}\r\n\r\n'


def test_a_partial_event_at_the_end_is_held_until_flushed() -> None:
    framer = SSEFramer(is_sse=True)
    assert framer.feed(b'data: {"a":1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    assert framer.flush() == b'data: {"b"'


def test_a_body_that_is_not_sse_passes_as_it_comes() -> None:
    framer = SSEFramer(is_sse=False)
    assert framer.feed(b'{"partial": ') == b'{"partial": '
