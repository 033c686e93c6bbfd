"""Serving a vLLM node's API: requests go to vLLM as they came, answers come back as vLLM
sent them.

vLLM's own server does everything people run it for: tools and tool_choice, structured
outputs, reasoning, multimodal parts, /v1/responses, Anthropic's /v1/messages, embeddings,
tokenize. The node's OpenAI server (completions.py, written for the torch engine) would
have to re-implement each, and silently dropped what it did not, so on a vLLM node the
body is passed through with one change: a fabric model name (`base:adapter`) becomes
vLLM's (`adapter`). SSE frames pass byte for byte, `event:` lines included (Anthropic's
client drops frames without them).

What the node adds is what the fabric needs around it: cluster-token auth (the app's
dependency), drain (the lifecycle's accepting flag and in-flight count), the request
journal (a generation is journalled completed only once vLLM's answer has been read to
its end), and abort on client disconnect: closing vLLM's connection is what makes vLLM
abort the request, for a stream as soon as the client goes and for a whole answer at the
next poll.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response
from opentelemetry import context as otel_context
from starlette.types import Receive, Scope, Send

from data_plane.engine.base import PassthroughEngine
from data_plane.runtime import NodeRuntime
from data_plane.server.body import decode_json_object, read_body
from data_plane.server.client_watch import unless_disconnected
from data_plane.server.errors import (
    ModelNotFoundError,
    UnavailableError,
)
from meridian.contracts import GENERATION_ROUTES, HEADER_REQUEST_ID, MODEL_ROUTES
from meridian.http_stream import ListenerStreamingResponse
from meridian.kv_transfer import is_prefill_request
from meridian.request_journal import RequestJournal
from meridian.tracing import inject

# Routes passed through; those in GENERATION_ROUTES are journalled and refused while draining.
POST_ROUTES = (*MODEL_ROUTES, "/v1/responses/{response_id}/cancel")
GET_ROUTES = ("/v1/responses/{response_id}",)
# Upstream answer headers kept; the rest (length, encoding, server) are the node's own.
_KEEP_HEADERS = ("content-type", "cache-control", "retry-after")


@dataclass(slots=True)
class _Call:
    """One request passed through: what the journal and the lifecycle need to close it."""

    key: str | None
    generation: bool
    # A P/D prefill hop (its kv_transfer_params ask for a remote decode): journalled as one.
    prefill: bool = False
    journalled: bool = False
    finished: bool = False


class _RelayedStream(ListenerStreamingResponse):
    """A relayed stream that always closes its upstream, however the client leaves (a
    client gone before the body was iterated included; on the node's listener a hang-up
    cancels it, meridian.http_stream)."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int, headers: dict[str, str], *,
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


class Passthrough:
    """The pass-through routes of a node whose engine has its own HTTP server."""

    def __init__(self, runtime: NodeRuntime, engine: PassthroughEngine, journal: RequestJournal) -> None:
        self._runtime = runtime
        self._engine = engine
        self._journal = journal
        self._settings = runtime.settings

    async def forward(self, request: Request, path: str) -> Response:
        """Pass `request` to the engine's server at `path` (its route with ids filled in)."""
        body, payload = b"", None
        if request.method == "POST":
            body, payload = self._rewrite_model(await read_body(request, self._settings.max_request_bytes))
        generation = path in GENERATION_ROUTES
        prefill = payload is not None and is_prefill_request(payload.get("kv_transfer_params"))
        call = _Call(key=request.headers.get(HEADER_REQUEST_ID), generation=generation, prefill=prefill)
        lifecycle = self._runtime.lifecycle
        # No await between this check and request_started(): a drain that begins
        # afterwards waits for this request.
        if generation and not lifecycle.accepting:
            code = "draining" if self._runtime.draining else "not_ready"
            raise UnavailableError(f"this node is {lifecycle.phase}; retry on another node", code=code)
        client = self._engine.upstream()
        lifecycle.request_started()
        try:
            # vLLM sends a whole answer's head only once it is generated: watch the client
            # from the start, not only once the body is being read.
            upstream = await unless_disconnected(
                request, client.send(self._upstream_request(client, request, path, body), stream=True),
                discard=httpx.Response.aclose)
        except httpx.HTTPError as exc:
            self._end(call, completed=False)
            raise UnavailableError(f"lost the connection to vLLM: {exc!r}", code="not_ready") from None
        except BaseException:
            self._end(call, completed=False)
            raise
        headers = {k: v for k in _KEEP_HEADERS if (v := upstream.headers.get(k)) is not None}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            headers["x-accel-buffering"] = "no"
            return _RelayedStream(self._relay(upstream, call), upstream.status_code, headers,
                                  on_close=lambda: self._close(upstream, call))
        try:
            try:
                content = await unless_disconnected(request, upstream.aread())
            except httpx.HTTPError as exc:
                raise UnavailableError(f"vLLM broke off its answer: {exc!r}", code="not_ready") from None
            # Journalled before the answer goes out: a client that got it finds it served.
            self._end(call, completed=upstream.status_code < 300)
        finally:
            await self._close(upstream, call)
        return Response(content, status_code=upstream.status_code, headers=headers)

    def _rewrite_model(self, body: bytes) -> tuple[bytes, dict[str, Any] | None]:
        """The body with the fabric's model name turned into vLLM's, and its JSON; 400 when
        not JSON (an empty body, as a cancel may send, passes as it is)."""
        if not body.strip():
            return body, None
        payload = decode_json_object(body)
        model = payload.get("model")
        if not isinstance(model, str):
            return body, payload  # vLLM answers for a missing or mistyped model in its own words
        upstream = self._engine.upstream_model(model)
        if upstream is None:
            raise ModelNotFoundError(model)
        if upstream == model:
            return body, payload
        payload["model"] = upstream
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), payload

    @staticmethod
    def _upstream_request(client: httpx.AsyncClient, request: Request, path: str, body: bytes) -> httpx.Request:
        headers = {"accept-encoding": "identity"}
        for name in ("content-type", "accept", HEADER_REQUEST_ID):
            if (value := request.headers.get(name)) is not None:
                headers[name] = value
        # The node's span (data_plane.server.tracing) as the parent of vLLM's own spans;
        # nothing when the node does not trace.
        headers.update(inject(otel_context.get_current()))
        return client.build_request(request.method, path, content=body, headers=headers,
                                    params=request.query_params)

    async def _relay(self, upstream: httpx.Response, call: _Call) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            # Headers are gone: the stream just ends short, journalled as not completed.
            self._end(call, completed=False)
            return
        self._end(call, completed=upstream.status_code < 300)

    async def _close(self, upstream: httpx.Response, call: _Call) -> None:
        await upstream.aclose()
        self._end(call, completed=False)

    def _end(self, call: _Call, *, completed: bool) -> None:
        """Journal the outcome once and leave the in-flight count once."""
        if call.generation and call.key is not None and not call.journalled:
            call.journalled = True
            self._journal.served(call.key, self._settings.node_id, completed, prefill=call.prefill)
        if not call.finished:
            call.finished = True
            self._runtime.lifecycle.request_finished()
