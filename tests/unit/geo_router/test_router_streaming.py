"""Streamed answers through the router: passthrough, failover before the first byte, breaks."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from router_harness import EU_KEY, GLOBAL_KEY, MODEL, Fabric, eventually

from geo_router.upstream import Origin, UpstreamConnection
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
