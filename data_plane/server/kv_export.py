"""A prefill node's held KV over HTTP, for decode nodes and routers (cluster token):

- `GET /v1/kv/{handle}`: the prompt's K/V, every layer, in the engine's KV payload format
  (data_plane.engine.kv_transfer.payload, `application/octet-stream`), and the blocks are
  released: one read per handle, as NIXL frees a prefill worker's blocks once read.
- `DELETE /v1/kv/{handle}`: release without reading (204): the router's call when the
  client went away or the decode failed, so blocks are not held to the lease's end.

An unknown, taken, released or expired handle is a 404 (`kv_not_found`) on both.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import Response

from data_plane.engine.kv_transfer.payload import KVLayout, KVPayload, encode
from data_plane.server.errors import APIError

MEDIA_TYPE = "application/octet-stream"


class KVTransferEngine(Protocol):
    """What an engine offers the KV routes (the torch engine)."""

    def kv_layout(self) -> KVLayout: ...

    async def take_kv(self, handle: str) -> KVPayload | None: ...

    async def release_kv(self, handle: str) -> bool: ...


class KVNotFoundError(APIError):
    status = 404
    type_ = "invalid_request_error"
    code = "kv_not_found"

    def __init__(self, handle: str) -> None:
        super().__init__(f"No KV is held under `{handle}` on this node (taken, released or expired).",
                         param="handle")


def kv_routes(app: FastAPI, engine: KVTransferEngine, dependencies: list[Any]) -> None:
    @app.get("/v1/kv/{handle}", dependencies=dependencies)
    async def export_kv(handle: str) -> Response:
        payload = await engine.take_kv(handle)
        if payload is None:
            raise KVNotFoundError(handle)
        # Copying out megabytes of tensor bytes is CPU work: off the event loop.
        body = await asyncio.to_thread(encode, payload)
        return Response(body, media_type=MEDIA_TYPE)

    @app.delete("/v1/kv/{handle}", dependencies=dependencies)
    async def release_kv(handle: str) -> Response:
        if not await engine.release_kv(handle):
            raise KVNotFoundError(handle)
        return Response(status_code=204)
