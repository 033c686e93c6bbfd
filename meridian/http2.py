"""HTTP/2 on a listener that serves HTTP/1.1 with uvicorn: the connections that speak it are
handed to hypercorn's HTTP/2 protocol, on the same port.

Why a hand-off and not another server: uvicorn speaks HTTP/1.1 only, and its listener
carries the fabric's limits (meridian.http_server) that every HTTP/1.1 client meets. A
connection speaks HTTP/2 either by prior knowledge (h2c: its first bytes are the HTTP/2
preface, as gRPC-style clients, Envoy and `curl --http2-prior-knowledge` send) or, over
TLS, by ALPN (`h2`, offered next to `http/1.1` by `alpn_config`). The listener's protocol
sees the preface or the ALPN choice before anything is parsed and hands the transport to
hypercorn's connection handler, which serves the same ASGI app (WebSocket mode stays
HTTP/1.1's upgrade; the h2c Upgrade header is not taken: clients that want h2c send the
preface).

Limits on an HTTP/2 connection: at most `max_streams` concurrent streams
(SETTINGS_MAX_CONCURRENT_STREAMS), a header list of at most max_header_bytes, the
keep-alive idle timeout, and the connection counts towards the listener's max_connections
while it lives (its place is held by a marker that uvicorn's shutdown asks to close, so a
SIGTERM drains HTTP/2 connections as it drains HTTP/1.1 ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig
from uvicorn.config import Config

log = logging.getLogger(__name__)

ALPN = ["h2", "http/1.1"]


class H2Handoff:
    """Serves the HTTP/2 connections of one listener with hypercorn's protocol."""

    def __init__(self, app: Any, *, max_streams: int, max_header_bytes: int, keep_alive_s: float) -> None:
        config = HypercornConfig()
        config.h2_max_concurrent_streams = max_streams
        config.h2_max_header_list_size = max_header_bytes
        config.keep_alive_timeout = keep_alive_s
        config.include_server_header = False
        config.accesslog = None
        config.errorlog = logging.getLogger("meridian.http2")
        self._config = config
        self._app = ASGIWrapper(app)
        self._context = WorkerContext(None)
        self._state: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def take(self, transport: asyncio.Transport, first: bytes, connections: set[Any]) -> None:
        """Serve the connection on `transport` over HTTP/2 from now on; `first`: what was
        read of it already. It holds a place in `connections` until it ends."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        if first:
            reader.feed_data(first)
        if not transport.is_reading():
            transport.resume_reading()
        marker = _Held(self)
        connections.add(marker)
        server = TCPServer(self._app, loop, self._config, self._context, self._state, reader, writer)
        task = loop.create_task(self._serve(server, marker, connections), name="http2-connection")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, server: TCPServer, marker: _Held, connections: set[Any]) -> None:
        try:
            await server.run()
        except Exception:  # noqa: BLE001 - one connection's failure must not reach the loop
            log.exception("HTTP/2 connection failed")
        finally:
            connections.discard(marker)

    def drain(self) -> None:
        """Stop taking new streams: connections close once their streams end (GOAWAY)."""
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._context.terminated.set())


class _Held:
    """An HTTP/2 connection's place among the listener's connections (uvicorn counts them
    and asks each to shut down on SIGTERM)."""

    def __init__(self, handoff: H2Handoff) -> None:
        self._handoff = handoff

    def shutdown(self) -> None:
        self._handoff.drain()


class AlpnConfig(Config):
    """uvicorn's Config whose TLS context offers h2 next to http/1.1 (ALPN)."""

    def load(self) -> None:
        super().load()
        if self.ssl is not None:
            self.ssl.set_alpn_protocols(ALPN)
