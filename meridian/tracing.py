"""OpenTelemetry tracing, set up the same way by every component (off by default).

Each app owns a `Tracing`: its own TracerProvider (never the process-global one, so that
several apps in one process, as in tests, each export to their own endpoints) and the W3C
propagators. `Tracing.off()` costs nothing: components check `tracing.enabled` before any
span work, so the request path is untouched when no endpoint is set.

Export is OTLP over HTTP/protobuf (`endpoint`: the collector's base URL, e.g.
`http://collector:4318`, or its full `/v1/traces` URL).

Residency: the router puts the tenant's residency zone (from its key) on its request span
as `meridian.zone`, and on the W3C `baggage` it sends the node (`meridian.zone=eu`); the
node's spans, and the engine's under them, take the zone from that baggage (`on_start`).
`ZoneRoutedProcessor` then exports each span to its zone's collector
(`zone_endpoints: {eu: https://otel.eu.example:4318}`), a span of another zone or of no
zone to `endpoint`; with no `endpoint`, such spans are dropped. So an operator keeps a
zone's traces within the zone. Only the router sets the zone: it extracts an incoming
`traceparent` (keeping the client's trace id) but never a client's `baggage`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ZONE_ATTRIBUTE = "meridian.zone"
ZONE_BAGGAGE = "meridian.zone"
TRACES_PATH = "/v1/traces"

_TRACE_CONTEXT = TraceContextTextMapPropagator()
_BAGGAGE = W3CBaggagePropagator()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector given by its base URL or that URL itself."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def otlp_exporter(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=10)


class ZoneRoutedProcessor(SpanProcessor):
    """Exports each ended span through its zone's processor, else the default one.

    A span started under baggage naming a zone gets that zone as its `meridian.zone`
    attribute (unless it set one itself), so a request's spans all follow its tenant's zone.
    """

    def __init__(self, default: SpanProcessor | None, zones: Mapping[str, SpanProcessor]) -> None:
        self._default = default
        self._zones = dict(zones)

    def _all(self) -> list[SpanProcessor]:
        return [p for p in (self._default, *self._zones.values()) if p is not None]

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        zone = baggage.get_baggage(ZONE_BAGGAGE, parent_context)
        if isinstance(zone, str) and zone and (span.attributes is None or ZONE_ATTRIBUTE not in span.attributes):
            span.set_attribute(ZONE_ATTRIBUTE, zone)

    def on_end(self, span: ReadableSpan) -> None:
        zone = (span.attributes or {}).get(ZONE_ATTRIBUTE)
        processor = self._zones.get(zone, self._default) if isinstance(zone, str) else self._default
        if processor is not None:
            processor.on_end(span)

    def shutdown(self) -> None:
        for p in self._all():
            p.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self._all())


@dataclass
class Tracing:
    """One app's tracer and propagation; `enabled` False: no provider, nothing exported."""

    provider: TracerProvider | None = None
    tracers: dict[str, trace.Tracer] = field(default_factory=dict)

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def create(
        cls,
        service_name: str,
        endpoint: str | None,
        zone_endpoints: Mapping[str, str] | None = None,
        *,
        attributes: Mapping[str, str] | None = None,
    ) -> Tracing:
        """Tracing to `endpoint` and the per-zone collectors; off when none is given."""
        zones = dict(zone_endpoints or {})
        if endpoint is None and not zones:
            return cls.off()
        default = BatchSpanProcessor(otlp_exporter(endpoint)) if endpoint is not None else None
        processor = ZoneRoutedProcessor(default, {z: BatchSpanProcessor(otlp_exporter(url)) for z, url in zones.items()})
        resource = Resource.create({"service.name": service_name, **(attributes or {})})
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(processor)
        return cls(provider)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def tracer(self, scope: str) -> trace.Tracer:
        """The tracer of instrumentation scope `scope` (a no-op one when tracing is off)."""
        tracer = self.tracers.get(scope)
        if tracer is None:
            tracer = self.tracers[scope] = (
                self.provider.get_tracer(scope) if self.provider is not None else trace.NoOpTracer()
            )
        return tracer

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000)) if self.provider is not None else True

    def shutdown(self) -> None:
        """Export what is buffered and stop (the app's shutdown)."""
        if self.provider is not None:
            self.provider.shutdown()


def extract_trace(headers: Mapping[str, str]) -> Context:
    """The caller's trace context (`traceparent`) only: its baggage is not trusted."""
    return _TRACE_CONTEXT.extract(headers)


def extract_all(headers: Mapping[str, str]) -> Context:
    """The trace context and the baggage (the zone) a router sent a node."""
    return _BAGGAGE.extract(headers, context=_TRACE_CONTEXT.extract(headers))


def with_zone(context: Context, zone: str) -> Context:
    return baggage.set_baggage(ZONE_BAGGAGE, zone, context)


def inject(context: Context) -> dict[str, str]:
    """The `traceparent` (and `baggage`) headers that continue `context` downstream."""
    carrier: dict[str, str] = {}
    _TRACE_CONTEXT.inject(carrier, context=context)
    _BAGGAGE.inject(carrier, context=context)
    return carrier
