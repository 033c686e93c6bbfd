"""A stream on meridian's own listener ends when its client hangs up, told by the listener
(meridian.http_stream), with no task per stream watching receive()."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from router_harness import ServerGroup

from meridian.http_server import limited_config
from meridian.http_stream import ListenerStreamingResponse
from meridian.settings import ListenerSettings


class Node:
    """A stream that sends one event and then waits for ever, as a stalled model would."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def events(self) -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.Future()
        finally:
            self.closed.set()


def app_of(node: Node) -> FastAPI:
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> ListenerStreamingResponse:
        return ListenerStreamingResponse(node.events(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("own_listener", [True, False], ids=["meridian-listener", "plain-uvicorn"])
async def test_a_client_hanging_up_ends_the_stream_quietly(own_listener: bool, caplog: pytest.LogCaptureFixture) -> None:
    node = Node()
    app = app_of(node)
    servers = ServerGroup()
    config = limited_config(app, ListenerSettings(), log_level="warning", timeout_graceful_shutdown=2) \
        if own_listener else None
    try:
        url = await servers.start(app, config=config)
        async with httpx.AsyncClient(base_url=url) as client, client.stream("GET", "/stream") as r:
            async for _ in r.aiter_bytes():
                break
        await asyncio.wait_for(node.closed.wait(), 5)
    finally:
        await servers.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
