"""The router's span of each routed request, and the trace context it sends the node.

One SERVER span per request (`router POST /v1/chat/completions`), continuing the client's
`traceparent` when it sent one (its trace id is kept; its baggage is ignored), else a new
trace. Once the tenant is known the span carries `meridian.tenant`, `meridian.zone` (the
residency zone of the tenant's key, which also decides which collector gets the spans:
meridian.tracing) and the model; each attempt sets the node and region tried and the
number of failover attempts. The node gets `traceparent` (this span as the parent) and
`baggage: meridian.zone=<zone>` on every attempt, so its spans and the engine's join the
trace and follow the tenant's zone. A stream's span ends when the stream does.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from meridian.contracts import TenantEntry
from meridian.tracing import ZONE_ATTRIBUTE, Tracing, extract_trace, inject, with_zone

from ..forwarding.streaming import when_stream_ends
from ..sse import StreamTally


class RequestTrace:
    """The span of one routed request and the headers that continue it at the node."""

    def __init__(self, tracing: Tracing, headers: Mapping[str, str], route: str, request_id: str) -> None:
        self._parent = extract_trace(headers)
        self.span: Span = tracing.tracer("meridian.router").start_span(
            f"router POST {route}", context=self._parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route, "meridian.request_id": request_id},
        )
        self._context = trace.set_span_in_context(self.span, self._parent)
        self.headers = _header_lines(self._context)

    def tenant(self, tenant: TenantEntry, model: str) -> None:
        """The authenticated tenant: its zone goes on the span and on the node's baggage."""
        self.span.set_attributes({"meridian.tenant": tenant.tenant, ZONE_ATTRIBUTE: tenant.zone,
                                  "gen_ai.request.model": model, "meridian.model": model})
        self._context = with_zone(self._context, tenant.zone)
        self.headers = _header_lines(self._context)

    def attempt(self, attempt: int, node: str, region: str) -> None:
        self.span.set_attributes({"meridian.node": node, "meridian.region": region,
                                  "meridian.failover_attempts": attempt - 1})

    def finish(self, response: Response) -> None:
        """End the span with the answer's status (a stream's when it ends)."""
        status = response.status_code
        self.span.set_attribute("http.response.status_code", status)

        def ended(tally: StreamTally) -> None:
            self.span.set_attribute("meridian.stream_events", tally.events)
            self._end(status)

        if not when_stream_ends(response, ended):
            self._end(status)

    def fail(self, status: int, message: str) -> None:
        self.span.set_attribute("http.response.status_code", status)
        self._end(status, message)

    def _end(self, status: int, message: str | None = None) -> None:
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.end()


def begin(tracing: Tracing, headers: Mapping[str, str], route: str, request_id: str) -> RequestTrace | None:
    """The request's trace, or None when tracing is off (nothing else is done then)."""
    return RequestTrace(tracing, headers, route, request_id) if tracing.enabled else None


def _header_lines(context: object) -> str:
    # Values from the propagators: a hex traceparent and an encoded baggage, no CR/LF.
    return "".join(f"{name}: {value}\r\n" for name, value in inject(context).items())  # type: ignore[arg-type]
