"""The node's span of each request a router sends it (OpenTelemetry, off by default).

A pure ASGI middleware, present only when the node has an OTLP endpoint: for each POST it
extracts the router's `traceparent` and `baggage` (the tenant's residency zone, which the
node's spans then carry: meridian.tracing), opens a SERVER span (`node POST <path>`) and
makes it the current context while the request is handled, so that the engine's spans
(data_plane.engine.tracing) and the `traceparent` passed on to vLLM are its children. The
span ends when the answer (a stream's last byte included) has been sent.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meridian.contracts import HEADER_REQUEST_ID
from meridian.tracing import Tracing, extract_all


class NodeTracingMiddleware:
    """Spans every POST of the node app (generation and pass-through routes)."""

    def __init__(self, app: ASGIApp, tracing: Tracing, node_id: str, region: str, model: str) -> None:
        self._app = app
        self._tracer = tracing.tracer("meridian.node")
        self._attributes = {"meridian.node": node_id, "meridian.region": region, "meridian.model": model}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = extract_all(headers)
        path = scope["path"]
        span = self._tracer.start_span(
            f"node POST {path}", context=parent, kind=SpanKind.SERVER,
            attributes={**self._attributes, "http.request.method": "POST", "url.path": path,
                        "meridian.request_id": headers.get(HEADER_REQUEST_ID, "")},
        )
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            await self._app(scope, receive, sending)
        except BaseException as exc:
            span.record_exception(exc)
            status = status or 500
            raise
        finally:
            otel_context.detach(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
