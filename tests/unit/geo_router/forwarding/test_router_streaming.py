"""Streamed answers through the router: passthrough, failover before the first byte, breaks."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    Fabric,
    ServerGroup,
    eventually,
    router_settings,
    serve_router,
)

from geo_router import create_app
from geo_router.forwarding.upstream import Origin, UpstreamConnection
from meridian.contracts import HEADER_NODE, HEADER_REGION, HEADER_REQUEST_ID

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


async def test_stream_is_passed_through_event_by_event(fabric: Fabric):
    client = fabric.client()
    async with client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers[HEADER_REGION] == "aws:us-east-1" and r.headers[HEADER_NODE] == "us-1"
        assert r.headers[HEADER_REQUEST_ID]
        body = (await r.aread()).decode()
    evs = events(body)
    assert evs[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in evs[:-1]] == [
        "us0 ", "us1 ", "us2 "]


async def test_node_dying_before_its_first_event_fails_over(fabric: Fabric):
    fabric.behaviours["us"].mode = "die_early"
    async with fabric.client().stream("POST", "/v1/chat/completions", json=CHAT) as r:
        assert r.status_code == 200 and r.headers[HEADER_REGION] == "gcp:europe-west4"
        body = (await r.aread()).decode()
    assert events(body)[-1] == "[DONE]" and "eu0" in body


async def test_a_stream_broken_midway_ends_with_an_error_event(fabric: Fabric):
    fabric.behaviours["us"].mode = "break"
    client = fabric.client()
    async with asyncio.timeout(5):  # never hangs
        async with client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            assert r.status_code == 200 and r.headers[HEADER_REGION] == "aws:us-east-1"
            body = (await r.aread()).decode()
    evs = events(body)
    # The two whole events, never the half one, then one error event and the end.
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in evs[:2]] == ["us0 ", "us1 "]
    assert len(evs) == 3
    error = json.loads(evs[2])["error"]
    assert error["code"] == "upstream_disconnected" and error["type"] == "server_error"
    # Once bytes went out, the router does not retry elsewhere.
    assert fabric.behaviours["eu"].hits == 0


async def test_client_disconnect_closes_the_upstream_stream(fabric: Fabric):
    us = fabric.behaviours["us"]
    us.mode = "slow"
    client = fabric.client()
    async with client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
        async for _ in r.aiter_bytes():
            break
    # The node's generator would run until the test ends; the router must stop it.
    await asyncio.wait_for(us.stream_closed.wait(), 3)
    fleet = fabric.app.state.router.fleet
    await eventually(lambda: fleet.in_flight("us-1") == 0)
    # A client leaving is not the node's fault: it is not ejected.
    us.mode = "ok"
    r = await client.post("/v1/chat/completions", json=CHAT | {"stream": False})
    assert r.headers[HEADER_NODE] == "us-1"


async def test_on_the_routers_own_listener_a_client_leaving_ends_the_stream_at_once(
    fabric: Fabric, caplog: pytest.LogCaptureFixture,
):
    """The listener tells the stream its client hung up (no task per stream waiting on
    receive()): the node's stream is closed, the request ends, and nothing is logged as an
    application error."""
    us = fabric.behaviours["us"]
    us.mode = "slow"
    settings = router_settings()
    app = create_app(settings, table_source=fabric.source)
    servers = ServerGroup()
    try:
        url = await serve_router(servers, app, settings)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {GLOBAL_KEY}"}) as client, \
                client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            async for _ in r.aiter_bytes():
                break
        await asyncio.wait_for(us.stream_closed.wait(), 3)
        fleet = app.state.router.fleet
        await eventually(lambda: fleet.in_flight("us-1") == 0)
    finally:
        await servers.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_official_openai_client_streams_and_sees_errors(fabric: Fabric):
    client = openai.AsyncOpenAI(base_url=fabric.router_url + "/v1", api_key=GLOBAL_KEY,
                                max_retries=0, timeout=10)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "us0 us1 us2 "

        fabric.behaviours["us"].mode = "break"
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(openai.APIError, match="stopped responding"):
            async for _ in stream:
                pass
    finally:
        await client.close()

    eu = openai.AsyncOpenAI(base_url=fabric.router_url + "/v1", api_key=EU_KEY, max_retries=0,
                            timeout=10)
    fabric.behaviours["eu"].mode = "error500"
    try:
        with pytest.raises(openai.APIStatusError) as e:
            await eu.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        assert e.value.status_code == 503 and e.value.body["code"] == "no_replica_in_zone"
    finally:
        await eu.close()


class _Transport:
    """Just enough of an asyncio transport to see whether its reading is paused."""

    def __init__(self) -> None:
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


async def test_a_slow_client_makes_the_router_stop_reading_from_the_node():
    # Backpressure: what the client has not taken yet is bounded; past that the router stops
    # reading, so TCP slows the node down instead of the router buffering a whole answer.
    conn = UpstreamConnection(Origin.parse("http://node.invalid"))
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.send(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n", b"")
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                       b"transfer-encoding: chunked\r\n\r\n")
    event = b"data: " + b"x" * 1000 + b"\n\n"
    chunk = f"{len(event):x}\r\n".encode() + event + b"\r\n"
    sent = 0
    while not transport.paused and sent < 10_000:
        conn.data_received(chunk)
        sent += 1
    assert transport.paused and 200 < sent < 400  # about 256 KiB held
    assert len(await conn.read_chunk()) == sent * len(event)
    assert not transport.paused


def _streaming_conn() -> UpstreamConnection:
    conn = UpstreamConnection(Origin.parse("http://node.invalid"))
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.send(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n", b"")
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                       b"transfer-encoding: chunked\r\n\r\n")
    return conn


def _chunk(event: bytes) -> bytes:
    return f"{len(event):x}\r\n".encode() + event + b"\r\n"


async def test_a_timed_read_ends_at_its_deadline_and_one_with_a_later_deadline_waits_for_it():
    # The per-chunk read timeout of a stream (read_chunk_by): one timer per connection that a
    # read moves only when it would fire late. What a caller sees is a timeout per read.
    conn = _streaming_conn()
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, conn.data_received, _chunk(b"data: 1\n\n"))
    assert await conn.read_chunk_by(loop.time() + 0.5) == b"data: 1\n\n"
    # The timer still points at the first read's deadline; this read's is later: it waits on.
    loop.call_later(0.6, conn.data_received, _chunk(b"data: 2\n\n"))
    assert await conn.read_chunk_by(loop.time() + 2.0) == b"data: 2\n\n"
    started = loop.time()
    with pytest.raises(TimeoutError):
        await conn.read_chunk_by(started + 0.1)
    assert 0.1 <= loop.time() - started < 1.0
    # A plain read (no deadline) is not ended by the timer a timed read left armed.
    loop.call_later(0.01, conn.data_received, _chunk(b"data: 3\n\n"))
    assert await conn.read_chunk_by(loop.time() + 0.1) == b"data: 3\n\n"
    loop.call_later(0.3, conn.data_received, _chunk(b"data: 4\n\n"))
    assert await conn.read_chunk() == b"data: 4\n\n"
