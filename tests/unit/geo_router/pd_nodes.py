"""Stand-in prefill and decode workers speaking the P/D hand-off (meridian.kv_transfer).

A prefill worker answers a `do_remote_decode` request with `kv_transfer_params` naming a
fresh handle, holds the handle until `DELETE /v1/kv/{handle}` or a decode worker's pull,
and records every body. A decode worker answers with the handle it was handed (or
"prefilled here" without one), so a test can see which prefill fed which decode.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from router_harness import MODEL

from meridian.contracts import KVConnector, KVTransferInfo, NodeRole, NodeStatus, RoutingNode, openai_error

_handles = itertools.count(1)


@dataclass
class PDBehaviour:
    """How a stand-in worker answers. mode: ok, error500, error400, hang (until `release`),
    no_params (a prefill answer without kv_transfer_params), die_early (a stream that closes
    before its first event)."""

    name: str
    mode: str = "ok"
    bodies: list[dict[str, Any]] = field(default_factory=list)
    held: set[str] = field(default_factory=set)
    released: list[str] = field(default_factory=list)
    received: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def hits(self) -> int:
        return len(self.bodies)


def _chat(content: str, prompt_tokens: int = 3) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}}


def pd_app(b: PDBehaviour, host: str = "127.0.0.1", port: int = 0) -> FastAPI:
    app = FastAPI()

    async def answer(request: Request) -> Response:
        body = await request.json()
        b.bodies.append(body)
        b.received.set()
        if b.mode == "hang":
            await b.release.wait()
        if b.mode == "error500":
            return JSONResponse(openai_error("engine crashed", "server_error"), status_code=500)
        if b.mode == "error400":
            return JSONResponse(openai_error("prompt too long", param="messages"), status_code=400)
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode"):
            if b.mode == "no_params":
                return JSONResponse(_chat("x"))
            handle = f"{b.name}-{next(_handles)}"
            b.held.add(handle)
            return JSONResponse(_chat("x") | {"kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": b.name,
                "remote_block_ids": [1, 2], "remote_host": host, "remote_port": port,
                "remote_request_id": handle}})
        content = f"decoded {params['remote_request_id']} on {b.name}" if params else f"prefilled here on {b.name}"
        if body.get("stream"):
            return StreamingResponse(_events(b, content), media_type="text/event-stream")
        return JSONResponse(_chat(content))

    async def release(handle: str) -> Response:
        b.released.append(handle)
        if handle not in b.held:
            return JSONResponse(openai_error("no such KV", code="not_found"), status_code=404)
        b.held.discard(handle)
        return Response(status_code=204)

    app.post("/v1/chat/completions")(answer)
    app.post("/v1/completions")(answer)
    app.delete("/v1/kv/{handle}")(release)
    return app


async def _events(b: PDBehaviour, content: str) -> AsyncIterator[str]:
    if b.mode == "die_early":
        raise RuntimeError("decode worker died before its first token")
    for word in content.split():
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}]}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def pd_node(node_id: str, url: str, region: str, role: NodeRole, *, lease_s: float = 60.0,
            connector: KVConnector = KVConnector.MERIDIAN) -> RoutingNode:
    port = url.rsplit(":", 1)[1]
    transfer = None if role is NodeRole.BOTH else KVTransferInfo(connector=connector, endpoint=f"127.0.0.1:{port}",
                                                                 lease_s=lease_s)
    return RoutingNode(node_id=node_id, region=region, url=url, models=[MODEL], status=NodeStatus.READY,
                       role=role, kv_transfer=transfer)
