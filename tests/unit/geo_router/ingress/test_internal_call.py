"""The pipeline's answer to a WebSocket turn or gRPC call (geo_router.ingress.internal_call), read
as those endpoints read it: the head, then whole events or the whole body; and ended when the
client leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, StreamingResponse

from geo_router.ingress.arrival import Departure
from geo_router.ingress.internal_call import Head, answer_events

SSE = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
       b'data: {"error":{"message":"broke","code":"upstream_disconnected"}}\n\n'
       b"data: [DONE]\n\n")


async def _read(response: object) -> list[object]:
    async with contextlib.aclosing(answer_events(response, Departure())) as parts:  # type: ignore[arg-type]
        return [part async for part in parts]


async def test_a_streamed_answer_is_its_whole_events_however_it_was_cut() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(SSE), 7):  # events split across chunks
            yield SSE[i:i + 7]

    parts = await _read(StreamingResponse(chunks(), media_type="text/event-stream"))
    assert isinstance(parts[0], Head) and parts[0].streamed
    assert parts[1:] == [{"type": "response.created", "sequence_number": 0},
                         {"error": {"message": "broke", "code": "upstream_disconnected"}}]


async def test_any_other_answer_is_its_head_and_whole_body() -> None:
    parts = await _read(JSONResponse({"error": {"message": "no"}}, status_code=404))
    assert isinstance(parts[0], Head) and (parts[0].status, parts[0].streamed) == (404, False)
    assert parts[1:] == [b'{"error":{"message":"no"}}']


async def test_the_client_leaving_between_two_events_ends_the_answer_at_once() -> None:
    # A node that stalls after its first event: nothing but the departure would end the wait.
    closed = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        try:
            yield b'data: {"n": 1}\n\n'
            await asyncio.Future()
        finally:
            closed.set()  # the stream's own cleanup ran: the node's connection is closed

    departure = Departure()
    got: list[object] = []
    async with asyncio.timeout(10), contextlib.aclosing(answer_events(
            StreamingResponse(stalls(), media_type="text/event-stream"), departure)) as parts:
        async for part in parts:
            got.append(part)
            if part == {"n": 1}:
                departure.left()
    assert got[1:] == [{"n": 1}] and closed.is_set()


async def test_a_long_lived_departure_keeps_no_callback_of_a_finished_answer() -> None:
    # One WebSocket connection, many turns, one Departure: each turn takes its callback back.
    departure = Departure()
    for _ in range(3):
        await _read(JSONResponse({"ok": True}))
        async with contextlib.aclosing(answer_events(StreamingResponse(iter([b"data: {}\n\n"]),
                                                                       media_type="text/event-stream"),
                                                     departure)) as parts:
            assert [p async for p in parts][1:] == [{}]
    assert not departure._callbacks
