"""HTTP/2 on a listener (meridian.http2): the control-frame meter's arithmetic on raw
bytes, and on a real uvicorn server with the hand-off, what a client meets: DATA (up or
down) never counts as control frames, a body that does not arrive in time is 408 in the
listener's format or, once the answer has started, a reset stream; and the gate that lets
those answers out a few per turn of the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import h2.events
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from h2.errors import ErrorCodes
from h2_client import H2Client, frame
from router_harness import ServerGroup

from meridian.http2 import FrameMeter, PerTurn
from meridian.http_server import ErrorBody, limited_config, openai_error_body, problem_body
from meridian.settings import ListenerSettings

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, WINDOW_UPDATE, DATA, HEADERS, CONTINUATION = 0x4, 0x6, 0x8, 0x0, 0x1, 0x9
BUDGET = 10
LIMITS = ListenerSettings(body_timeout_s=0.5, http2_max_control_frames_per_s=BUDGET)


# --- the meter --------------------------------------------------------------------------


def test_control_frames_past_the_budget_within_a_second_are_refused() -> None:
    meter = FrameMeter(BUDGET)
    assert meter.feed(PREFACE + frame(SETTINGS) * 6, now=0.0)
    assert meter.feed(frame(PING, b"8 bytes!") * 4, now=0.5)  # ten in the second: allowed
    assert not meter.feed(frame(0xFA), now=0.9)  # an unknown type counts too
    meter = FrameMeter(BUDGET)
    assert meter.feed(PREFACE + frame(SETTINGS) * 10, now=0.0)
    assert meter.feed(frame(SETTINGS) * 10, now=1.0)  # a new second


def test_requests_and_their_data_are_not_control_frames() -> None:
    meter = FrameMeter(BUDGET)
    traffic = b"".join(frame(HEADERS, b"h" * 20, stream_id=s) + frame(CONTINUATION, b"c", stream_id=s)
                       + frame(DATA, b"d" * 1000, stream_id=s) + frame(DATA, b"", flags=0x1, stream_id=s)
                       for s in range(1, 200, 2))
    assert meter.feed(PREFACE + traffic, now=0.0)
    # An empty DATA frame that does not end its stream carries nothing: it counts.
    assert not meter.feed(frame(DATA, b"", stream_id=201) * (BUDGET + 1), now=0.1)


def test_frame_heads_cut_anywhere_by_reads_are_counted_alike() -> None:
    stream = PREFACE + b"".join(frame(DATA, b"x" * n, stream_id=1) + frame(SETTINGS) for n in (0, 1, 8, 9, 300))
    for size in (1, 2, 5, 9, 10, 17):
        meter = FrameMeter(6)  # 5 SETTINGS and 1 empty DATA
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert all(meter.feed(chunk, now=0.0) for chunk in chunks), size
        assert not meter.feed(frame(SETTINGS), now=0.0), size


def test_window_updates_answering_data_sent_are_free() -> None:
    meter = FrameMeter(BUDGET)
    for _ in range(50):
        meter.sent(frame(DATA, b"x" * 100, stream_id=1))
        meter.sent(frame(SETTINGS, flags=0x1))  # an ACK earns nothing
    update = frame(WINDOW_UPDATE, (100).to_bytes(4, "big"), stream_id=1)
    # Two per DATA frame, up to the budget banked: BUDGET free, then BUDGET counted.
    assert meter.feed(PREFACE + update * 2 * BUDGET, now=0.0)
    assert not meter.feed(update, now=0.0)


def test_goaway_names_the_last_stream_taken_and_calm() -> None:
    meter = FrameMeter(BUDGET)
    assert meter.feed(PREFACE + frame(HEADERS, b"h", flags=0x4, stream_id=7), now=0.0)
    # The read that goes over the budget is dropped whole: its stream 9 was never taken.
    assert not meter.feed(frame(HEADERS, b"h", stream_id=9) + frame(SETTINGS) * (BUDGET + 1), now=0.0)
    goaway = meter.goaway()
    assert goaway[:9] == bytes([0, 0, 8, 0x7, 0, 0, 0, 0, 0])
    assert int.from_bytes(goaway[9:13], "big") == 7
    assert int.from_bytes(goaway[13:17], "big") == ErrorCodes.ENHANCE_YOUR_CALM


# --- on a listener ------------------------------------------------------------------------


def app_with_routes() -> FastAPI:
    app = FastAPI()

    @app.get("/big")
    async def big() -> Response:
        return Response(b"x" * (1 << 20), media_type="application/octet-stream")

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @app.post("/early")
    async def early(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"started "
            yield b"%d" % len(await request.body())

        return StreamingResponse(chunks())

    return app


@contextlib.asynccontextmanager
async def serving(error_body: ErrorBody = openai_error_body) -> AsyncIterator[int]:
    app = app_with_routes()
    servers = ServerGroup()
    config = limited_config(app, LIMITS, error_body, http2_max_streams=10, log_level="warning",
                            timeout_keep_alive=5, timeout_graceful_shutdown=2)
    try:
        url = await servers.start(app, config=config)
        yield int(url.rsplit(":", 1)[1])
    finally:
        await servers.stop()


def ended(stream_id: int):  # type: ignore[no-untyped-def]
    return lambda e: isinstance(e, h2.events.StreamEnded) and e.stream_id == stream_id


async def test_a_fast_download_with_small_windows_is_not_cut_off() -> None:
    # The client's 64 KiB windows make it send two WINDOW_UPDATEs per 32 KiB received: 64
    # for 1 MiB, within a second, against a budget of 10.
    async with serving() as port:
        client = await H2Client.open(port)
        try:
            for stream_id in (1, 3):
                client.request(stream_id, "GET", "/big")
                await client.flush()
                await client.until(ended(stream_id), 10)
                assert client.status(stream_id) == 200 and len(client.body(stream_id)) == 1 << 20
            assert client.sent[WINDOW_UPDATE] > 4 * BUDGET
        finally:
            client.close()


async def test_an_upload_in_many_frames_arrives_whole() -> None:
    async with serving() as port:
        client = await H2Client.open(port)
        try:
            client.request(1, "POST", "/echo", {"content-type": "application/octet-stream"}, end=False)
            body = b"y" * (2 << 20)
            sent = 0
            while sent < len(body):
                window = min(client.conn.local_flow_control_window(1), client.conn.max_outbound_frame_size)
                if window == 0:
                    await client.until(lambda e: isinstance(e, h2.events.WindowUpdated), 5)
                    client.events.clear()
                    continue
                client.conn.send_data(1, body[sent:sent + window], end_stream=sent + window >= len(body))
                sent += window
                await client.flush()
            await client.until(ended(1), 10)
            assert client.status(1) == 200 and json.loads(client.body(1)) == {"bytes": 2 << 20}
        finally:
            client.close()


async def test_a_late_body_is_408_in_the_listeners_format() -> None:
    async with serving(problem_body) as port:
        client = await H2Client.open(port)
        try:
            client.request(1, "POST", "/echo", {"content-type": "application/json"}, b"{", end=False)
            await client.flush()
            await client.until(ended(1), LIMITS.body_timeout_s + 2)
            assert client.status(1) == 408
            assert json.loads(client.body(1))["status"] == 408
            reset = await client.until(lambda e: isinstance(e, h2.events.StreamReset), 2)
            assert (reset.stream_id, reset.error_code) == (1, ErrorCodes.NO_ERROR)
        finally:
            client.close()


async def test_a_late_body_after_the_answer_started_resets_the_stream() -> None:
    async with serving() as port:
        client = await H2Client.open(port)
        try:
            client.request(1, "POST", "/early", {}, b"partial", end=False)
            await client.flush()
            reset = await client.until(lambda e: isinstance(e, h2.events.StreamReset), LIMITS.body_timeout_s + 2)
            assert (reset.stream_id, reset.error_code) == (1, ErrorCodes.CANCEL)
            assert client.status(1) == 200 and client.body(1) == b"started "
            client.request(3, "POST", "/echo", {}, b"{}")
            await client.flush()
            await client.until(ended(3), 5)
            assert json.loads(client.body(3)) == {"bytes": 2}
        finally:
            client.close()


# --- expired streams, a few per turn ----------------------------------------------------


async def test_at_most_n_pass_per_turn_of_the_loop_in_the_order_they_came() -> None:
    turn = 0

    def tick() -> None:
        nonlocal turn
        turn += 1
        asyncio.get_running_loop().call_soon(tick)

    passed: list[tuple[int, int]] = []

    async def taker(i: int) -> None:
        await gate.take()
        passed.append((i, turn))

    gate = PerTurn(3)
    asyncio.get_running_loop().call_soon(tick)
    takers = [asyncio.create_task(taker(i)) for i in range(10)]
    cancelled = asyncio.create_task(taker(99))
    await asyncio.sleep(0)
    cancelled.cancel()  # waiting, then gone: it takes no place
    await asyncio.gather(*takers)

    assert [i for i, _ in passed] == list(range(10))
    per_turn = [sum(1 for _, t in passed if t == k) for k in {t for _, t in passed}]
    assert max(per_turn) <= 3 and len(per_turn) >= 4
    # Nothing is held while the gate is idle: a later caller passes at once.
    await asyncio.sleep(0)
    await asyncio.wait_for(gate.take(), 1)
