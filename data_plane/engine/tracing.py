"""The engine's spans of one generation (OpenTelemetry; only when the node traces).

`traced` wraps an engine's output stream (Engine.generate) in an `engine generate` span
with two children: `engine prefill` (submitted until the first token: queueing, prefill
and the first decode step, with the prompt and prefix-cache token counts) and `engine
decode` (the first token until the last, with the completion token count and finish
reason). Their parent is the context current when `traced` is called (the node's request
span), captured then, so it does not matter which task later iterates the stream. Spans are
started and ended explicitly, never made current: an async generator's code may resume in
another task's context.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from data_plane.engine.base import GenerationOutput, GenerationRequest


def traced(
    outputs: AsyncGenerator[GenerationOutput, None], tracer: Tracer, request: GenerationRequest, engine: str
) -> AsyncGenerator[GenerationOutput, None]:
    parent = otel_context.get_current()
    root = tracer.start_span("engine generate", context=parent, attributes={
        "meridian.engine": engine, "meridian.engine_request_id": request.request_id,
        "gen_ai.request.max_tokens": request.sampling_params.max_tokens,
    })
    return _traced(outputs, tracer, root, trace.set_span_in_context(root, parent))


async def _traced(
    outputs: AsyncGenerator[GenerationOutput, None], tracer: Tracer, root: Span, ctx: otel_context.Context
) -> AsyncGenerator[GenerationOutput, None]:
    prefill: Span | None = tracer.start_span("engine prefill", context=ctx)
    decode: Span | None = None
    last: GenerationOutput | None = None
    try:
        async for out in outputs:
            if prefill is not None:
                prefill.set_attributes({"gen_ai.usage.input_tokens": out.prompt_tokens,
                                        "meridian.cached_tokens": out.cached_tokens})
                prefill.end()
                prefill = None
                decode = tracer.start_span("engine decode", context=ctx)
            last = out
            yield out
    except GeneratorExit:
        raise  # the consumer stopped reading (a client gone): not an engine failure
    except BaseException as exc:
        root.record_exception(exc)
        root.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        await outputs.aclose()
        for span in (prefill, decode):
            if span is not None:
                if last is not None:
                    span.set_attribute("gen_ai.usage.output_tokens", last.completion_tokens)
                span.end()
        if last is not None:
            root.set_attributes({"gen_ai.usage.input_tokens": last.prompt_tokens,
                                 "gen_ai.usage.output_tokens": last.completion_tokens,
                                 "gen_ai.response.finish_reasons": [last.finish_reason or "none"]})
        root.end()
