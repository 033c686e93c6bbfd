"""The node's HTTP app: OpenAI-compatible generation, model listing, health and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from data_plane.engine.base import Engine, PassthroughEngine, create_engine
from data_plane.lifecycle import Phase
from data_plane.runtime import NodeRuntime
from data_plane.server.auth import internal_auth
from data_plane.server.completions import CompletionService
from data_plane.server.errors import ModelNotFoundError, install_error_handlers
from data_plane.server.kv_export import KVTransferEngine, kv_routes
from data_plane.server.kv_pull import KVPuller
from data_plane.server.kv_transfer import takes_part
from data_plane.server.metrics import NodeMetrics
from data_plane.server.passthrough import GET_ROUTES, POST_ROUTES, Passthrough
from data_plane.server.tokenize import DetokenizeResponse, TokenizationService, TokenizeResponse
from data_plane.server.tracing import NodeTracingMiddleware
from data_plane.weights.node_weights import with_model_uri
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import ModelCard, ModelList
from meridian.request_journal import RequestJournal
from meridian.settings.node import NodeSettings
from meridian.tracing import Tracing


def create_app(
    settings: NodeSettings, engine: Engine | None = None, *, clock: Clock = SYSTEM_CLOCK
) -> FastAPI:
    """Build a node app. Its lifespan starts the agent, loads the model in the
    background (app.state.runtime.wait_ready() waits for it) and drains on exit.

    `engine` defaults to create_engine(settings.engine, settings); the app owns its
    start and stop either way. `clock` is the node's one clock (the runtime, its agent
    and the engine read time from it); tests pass a ManualClock.
    """
    settings = with_model_uri(settings)
    if engine is None:
        engine = create_engine(settings.engine, settings, clock=clock)
    runtime = NodeRuntime(settings, engine, clock=clock)
    metrics = _node_metrics(settings, engine)
    metrics.track_cold_start(lambda: runtime.cold_start)
    runtime.request_totals = metrics.request_totals
    journal = RequestJournal(settings.request_journal_path)
    tracing = Tracing.create("meridian-node", settings.otlp_endpoint, settings.otlp_zone_endpoints,
                             attributes={"meridian.node": settings.node_id, "meridian.region": settings.region})
    passthrough = isinstance(engine, PassthroughEngine)
    kv_puller = None
    if not passthrough and takes_part(settings):
        kv_engine = cast(KVTransferEngine, engine)
        kv_puller = KVPuller(settings, kv_engine.kv_layout, on_outcome=metrics.kv_pulled)
    service = CompletionService(runtime, metrics, journal, tracing, kv_puller)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await runtime.start()
            yield
        finally:
            await runtime.shutdown()
            if kv_puller is not None:
                await kv_puller.aclose()
            journal.close()
            await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(
        title="Meridian node", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.runtime = runtime
    app.state.metrics = metrics
    app.state.tracing = tracing
    if tracing.enabled:
        models = engine.models()
        app.add_middleware(NodeTracingMiddleware, tracing=tracing, node_id=settings.node_id,
                           region=settings.region, model=models[0] if models else "")
    install_error_handlers(app)
    # Generation is for routers only; /health and /metrics stay open for probes and scrapers.
    internal = [Depends(internal_auth(settings))]

    if kv_puller is not None:
        kv_routes(app, cast(KVTransferEngine, engine), internal)
    if isinstance(engine, PassthroughEngine):
        _pass_through(app, Passthrough(runtime, engine, journal), internal)
    else:
        @app.post("/v1/chat/completions", dependencies=internal)
        async def chat_completions(request: Request) -> Response:
            return await service.chat(request)

        @app.post("/v1/completions", dependencies=internal)
        async def completions(request: Request) -> Response:
            return await service.completion(request)

        # vLLM's paths and bodies: what a vLLM node passes through to vLLM.
        tokenization = TokenizationService(settings, engine.get_tokenizer, service.resolve_model)

        @app.post("/tokenize", dependencies=internal)
        async def tokenize(request: Request) -> TokenizeResponse:
            return await tokenization.tokenize(request)

        @app.post("/detokenize", dependencies=internal)
        async def detokenize(request: Request) -> DetokenizeResponse:
            return await tokenization.detokenize(request)

    _model_routes(app, service, int(clock.time()), internal)
    if runtime.weights is not None:
        # Same-region peers fetch this node's cached weights (cluster token, like routers).
        app.include_router(runtime.weights.router(), dependencies=internal)
    _probe_routes(app, runtime, metrics, engine)
    return app


def _node_metrics(settings: NodeSettings, engine: Engine) -> NodeMetrics:
    # An engine with its own server (vLLM) measures requests and exports its cache config
    # itself; its families are relayed on /metrics.
    models = engine.models()
    passthrough = isinstance(engine, PassthroughEngine)
    return NodeMetrics(
        models[0] if models else "", engine.stats,
        cache_config=None if passthrough else {
            "block_size": str(settings.block_size),
            "enable_prefix_caching": str(settings.enable_prefix_caching),
        },
        request_metrics=not passthrough,
    )


def _model_routes(app: FastAPI, service: CompletionService, started: int, dependencies: list[Any]) -> None:
    """/v1/models and /v1/models/{id}: the models this node serves, created at `started`."""

    @app.get("/v1/models", dependencies=dependencies)
    async def list_models() -> ModelList:
        return await service.model_list(started)

    @app.get("/v1/models/{model_id:path}", dependencies=dependencies)
    async def get_model(model_id: str) -> ModelCard:
        # vLLM has no such route; the card is the list's.
        for card in (await service.model_list(started)).data:
            if card.id == model_id:
                return card
        raise ModelNotFoundError(model_id)


def _probe_routes(app: FastAPI, runtime: NodeRuntime, metrics: NodeMetrics, engine: Engine) -> None:
    """/health (200 only when ready) and /metrics, open to probes and scrapers."""

    @app.get("/health")
    async def health() -> JSONResponse:
        phase = runtime.lifecycle.phase
        return JSONResponse({"status": str(phase)}, status_code=200 if phase is Phase.READY else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = metrics.render()
        raw_metrics = getattr(engine, "raw_metrics", None)
        if raw_metrics is not None:
            # A vLLM child's own metrics, minus the families this node already exports.
            body += (await raw_metrics(metrics.family_names())).encode()
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def _pass_through(app: FastAPI, passthrough: Passthrough, dependencies: list[Any]) -> None:
    """Every route of the engine's server the fabric serves, passed through unchanged."""

    def add(method: str, route: str) -> None:
        async def endpoint(request: Request) -> Response:
            return await passthrough.forward(request, request.url.path)

        app.add_api_route(route, endpoint, methods=[method], dependencies=dependencies,
                          name=f"passthrough {method} {route}")

    for route in POST_ROUTES:
        add("POST", route)
    for route in GET_ROUTES:
        add("GET", route)
