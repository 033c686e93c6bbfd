"""The listener limits every Meridian HTTP server runs with (meridian.http_server), on a
real uvicorn server: head size (431), head and body timeouts (408), the connection cap
(503), each in the listener's error format, kept-alive requests limited like the first, and
pipelined requests queued no further than max_pipelined_requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request
from router_harness import ServerGroup, eventually

from meridian.http_server import (
    CLIENT_KEEPALIVE_S,
    SERVER_KEEPALIVE_S,
    limited_config,
    openai_error_body,
    problem_body,
)
from meridian.settings import ListenerSettings

LIMITS = ListenerSettings(max_header_bytes=2048, header_timeout_s=0.5, body_timeout_s=0.5, max_connections=3)


def echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    return app


@contextlib.asynccontextmanager
async def serving(error_body=openai_error_body, limits: ListenerSettings = LIMITS) -> AsyncIterator[int]:  # type: ignore[no-untyped-def]
    app = echo_app()
    servers = ServerGroup()
    config = limited_config(app, limits, error_body, log_level="warning", timeout_keep_alive=5,
                            timeout_graceful_shutdown=2)
    try:
        url = await servers.start(app, config=config)
        yield int(url.rsplit(":", 1)[1])
    finally:
        await servers.stop()


async def exchange(port: int, data: bytes, within_s: float = 5) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        async with asyncio.timeout(within_s):
            return await reader.read()
    finally:
        writer.close()


def body_of(answer: bytes) -> dict[str, object]:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])  # type: ignore[no-any-return]


def post(body: bytes, close: bool = True) -> bytes:
    conn = b"connection: close\r\n" if close else b""
    return b"POST /echo HTTP/1.1\r\nhost: x\r\n" + conn + b"content-length: %d\r\n\r\n" % len(body) + body


async def test_an_oversized_head_is_431_in_the_listeners_format() -> None:
    async with serving() as port:
        answer = await exchange(port, b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096 + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert body_of(answer)["error"]["code"] == "request_header_fields_too_large"  # type: ignore[index]
    async with serving(problem_body) as port:
        answer = await exchange(port, b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096)
        assert answer.startswith(b"HTTP/1.1 431 ") and b"application/problem+json" in answer
        assert body_of(answer)["status"] == 431


async def test_kept_alive_requests_are_served_and_limited_like_the_first() -> None:
    async with serving() as port:
        # Two requests on one connection, then a third whose head stalls.
        answer = await exchange(port, post(b"{}", close=False) + post(b"[1]", close=False) + b"POST /ec")
        assert answer.count(b"HTTP/1.1 200 ") == 2 and b'{"bytes":3}' in answer
        assert answer.split(b"HTTP/1.1 ")[-1].startswith(b"408 ")


async def test_a_stalled_head_or_body_is_408() -> None:
    async with serving() as port:
        for partial in (b"", b"POST /echo HTTP/1.1\r\nhost: x\r\n", post(b"{}")[:-1]):
            answer = await exchange(port, partial)
            assert answer.startswith(b"HTTP/1.1 408 "), (partial, answer)
            assert body_of(answer)["error"]["code"] == "request_timeout"  # type: ignore[index]


def gated_app(gate: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/hold")
    async def hold() -> dict[str, bool]:
        await gate.wait()
        return {"held": True}

    @app.get("/n/{i}")
    async def number(i: int) -> dict[str, int]:
        return {"i": i}

    return app


async def test_pipelined_requests_queue_no_further_than_the_limit_and_all_are_answered_in_order() -> None:
    # Issue 33, finding 1: one connection pipelining GETs grew the router by 430 MiB, since
    # every request read was queued. 3,000 behind one that is held, in a single write.
    gate = asyncio.Event()
    app = gated_app(gate)
    limits = ListenerSettings(header_timeout_s=5, body_timeout_s=5, max_pipelined_requests=4)
    servers = ServerGroup()
    url = await servers.start(app, config=limited_config(app, limits, log_level="warning",
                                                         timeout_graceful_shutdown=2))
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        writer.write(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n" + b"".join(
            b"GET /n/%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(3000)))
        await writer.drain()
        await eventually(lambda: any(conn.flow.read_paused for conn in servers.connections()))
        for _ in range(20):  # the loop turns; nothing more is parsed while the first is held
            await asyncio.sleep(0)
        [conn] = servers.connections()
        assert len(conn.pipeline) == 4
        gate.set()
        answers = b""
        async with asyncio.timeout(30):
            while answers.count(b"HTTP/1.1 200 ") < 3001:
                answers += await reader.read(65536) or b"EOF"
                assert not answers.endswith(b"EOF"), "the connection was closed"
        assert [int(i) for i in re.findall(rb'\{"i":(\d+)\}', answers)] == list(range(3000))
    finally:
        writer.close()
        await servers.stop()


async def test_connections_past_the_cap_are_refused_with_retry_after() -> None:
    async with serving() as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        answer = await exchange(port, post(b"{}"))
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1\r\n" in answer
        for _, w in held:
            w.close()


async def test_connections_past_a_clients_cap_are_refused_and_freed_when_it_closes_one() -> None:
    limits = LIMITS.model_copy(update={"max_connections": 50, "max_connections_per_client": 2})
    async with serving(limits=limits) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        answer = await exchange(port, post(b"{}"))
        assert answer.startswith(b"HTTP/1.1 503 ") and b"your address" in answer
        held[0][1].close()
        for _ in range(100):  # until the server has seen it close
            answer = await exchange(port, post(b"{}"))
            if answer.startswith(b"HTTP/1.1 200 "):
                break
            await asyncio.sleep(0.02)
        assert answer.startswith(b"HTTP/1.1 200 ")
        held[1][1].close()


@pytest.mark.parametrize("limit", [1023, 0])
def test_limits_are_validated(limit: int) -> None:
    with pytest.raises(ValueError):
        ListenerSettings(max_header_bytes=limit)



def test_a_listener_keeps_an_idle_connection_longer_than_any_client_of_ours_pools_it() -> None:
    """The client lets an idle connection go first: a request on a pooled connection never
    crosses the server's keep-alive close (at 5 s and 5 s, one in 30 did: ReadError)."""
    config = limited_config(echo_app(), ListenerSettings())  # a node's, the control plane's
    assert config.timeout_keep_alive == SERVER_KEEPALIVE_S
    for pooled in (CLIENT_KEEPALIVE_S, httpx.Limits().keepalive_expiry):  # ours, httpx's default
        assert pooled is not None and config.timeout_keep_alive >= 2 * pooled
