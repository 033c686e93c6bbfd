"""A request of another protocol through an ASGI answer (geo_router.internal_call), read as
the WebSocket and gRPC endpoints read it: the head, then whole events or the whole body."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, StreamingResponse

from geo_router.internal_call import Departure, Head, answer_events, http_request

SSE = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
       b'data: {"error":{"message":"broke","code":"upstream_disconnected"}}\n\n'
       b"data: [DONE]\n\n")


async def _read(response: object) -> list[object]:
    request = http_request("/v1/completions", [], b"{}", Departure(), client=None)
    async with contextlib.aclosing(answer_events(response, request)) as parts:  # type: ignore[arg-type]
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
