"""The geo router's HTTP app: one global OpenAI-compatible endpoint in front of every node."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from meridian.contracts import HEADER_REQUEST_ID, HEADER_SCALE_WAIT_MS, ModelCard, ModelList
from meridian.settings import RouterSettings

from .auth import authenticate
from .errors import (
    ModelNotFound,
    NoHealthyReplica,
    NoReplicaInZone,
    RouterError,
    RoutingTableUnavailable,
    install_error_handlers,
)
from .health import FleetState, InProcessFleetState
from .locate import locate_client
from .metrics import RouterMetrics
from .proxy import UpstreamForwarder
from .redis_fleet import RedisFleetState
from .request import parse_inference_request, read_body, request_id_for
from .scale_from_zero import ScaleFromZero, ScaleUpClient, awaiting_scale_up, deployed_models
from .selection import (
    RoutingContext,
    RoutingPolicy,
    create_policy,
    exhausted_error,
    models_for,
    select_candidates,
)
from .table import LoadedTable, RoutingTableClient, TableSource

log = logging.getLogger(__name__)

# uvicorn waits this long for open streams to finish on SIGTERM before cutting them.
_SHUTDOWN_GRACE_S = 30


@dataclass(slots=True)
class RouterState:
    """Everything one router app owns (reachable as `app.state.router`)."""

    settings: RouterSettings
    table_source: TableSource
    fleet: FleetState
    policy: RoutingPolicy
    metrics: RouterMetrics
    forwarder: UpstreamForwarder
    scale_from_zero: ScaleFromZero

    def table(self) -> LoadedTable:
        loaded = self.table_source.current()
        if loaded is None:
            raise RoutingTableUnavailable()
        return loaded


def create_app(
    settings: RouterSettings,
    table_source: TableSource | None = None,
    *,
    fleet: FleetState | None = None,
) -> FastAPI:
    """Build the router app; its lifespan starts the routing-table source and fleet sync.

    Without `fleet`, node health is shared through Redis when `settings.redis_url` is set
    (the app then starts and stops that sync), else kept in this process.
    """
    source: TableSource = table_source if table_source is not None else RoutingTableClient(settings)
    shared_fleet: RedisFleetState | None = None
    fleet_state: FleetState
    if fleet is not None:
        fleet_state = fleet
    elif settings.redis_url:
        fleet_state = shared_fleet = RedisFleetState.from_settings(settings)
    else:
        fleet_state = InProcessFleetState(settings.ejection_base_s, settings.ejection_max_s)

    def table_version() -> float:
        loaded = source.current()
        return float(loaded.version) if loaded is not None else -1.0

    metrics = RouterMetrics(table_version)
    state = RouterState(
        settings=settings,
        table_source=source,
        fleet=fleet_state,
        policy=create_policy(settings.routing_policy, settings),
        metrics=metrics,
        forwarder=UpstreamForwarder(settings, fleet_state, metrics),
        scale_from_zero=ScaleFromZero(settings, source, metrics, ScaleUpClient(settings, metrics)),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if shared_fleet is not None:
            await shared_fleet.start()
        try:
            await source.start()
            try:
                yield
            finally:
                await source.stop()
                await state.scale_from_zero.aclose()
                await state.forwarder.aclose()
        finally:
            if shared_fleet is not None:
                await shared_fleet.stop()

    app = FastAPI(title="Meridian geo router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = state
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _route(state, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _route(state, request, "/v1/completions")

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        loaded = state.table()
        tenant = authenticate(loaded, request.headers.get("authorization"))
        # A deployed model is listed while scaled to zero: a request for it starts a replica.
        names = set(models_for(loaded, tenant)) | set(deployed_models(loaded, tenant))
        cards = [ModelCard(id=m) for m in sorted(names)]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        loaded = source.current()
        if loaded is None:
            return JSONResponse({"status": "no_routing_table"}, status_code=503)
        return JSONResponse({"status": "ok", "routing_version": loaded.version})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _route(state: RouterState, request: Request, route: str) -> Response:
    request_id = request_id_for(request.headers.get(HEADER_REQUEST_ID))
    request.state.request_id = request_id
    try:
        loaded = state.table()
        tenant = authenticate(loaded, request.headers.get("authorization"))
        body = await read_body(request, state.settings.max_request_bytes)
        received_at = time.perf_counter()
        inference = parse_inference_request(body)
        location = locate_client(
            request.headers.get(state.settings.client_location_header),
            state.settings.default_client_location,
            loaded.regions,
        )
        queued_s = 0.0
        try:
            candidates = select_candidates(loaded, tenant, inference.model, state.fleet, location)
        except (ModelNotFound, NoHealthyReplica, NoReplicaInZone):
            if awaiting_scale_up(loaded, tenant, inference.model) is None:
                raise
            held_at = time.perf_counter()
            candidates = await state.scale_from_zero.hold(
                tenant,
                inference.model,
                location,
                lambda table: select_candidates(table, tenant, inference.model, state.fleet, location),
                request.receive,
            )
            queued_s = time.perf_counter() - held_at
        ctx = RoutingContext(
            tenant=tenant,
            model=inference.model,
            stream=inference.stream,
            client_location=location,
            request_id=request_id,
            payload=inference.payload,
        )
        ordered = state.policy.order(candidates, ctx)
        response = await state.forwarder.forward(
            route,
            inference,
            ordered,
            request_id,
            received_at,
            exhausted=exhausted_error(tenant, inference.model),
            queued_s=queued_s,
        )
        if queued_s:
            response.headers[HEADER_SCALE_WAIT_MS] = f"{queued_s * 1000:.0f}"
        return response
    except RouterError as exc:
        state.metrics.requests.labels("", "", str(exc.status)).inc()
        raise


def serve(settings: RouterSettings) -> None:
    """Run the router under uvicorn until SIGTERM/SIGINT."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        lifespan="on",
        timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
    )
    uvicorn.Server(config).run()
