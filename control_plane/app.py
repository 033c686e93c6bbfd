"""The control plane's FastAPI app and its uvicorn runner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError

from control_plane import keystore, openapi_doc
from control_plane.api import (
    audit_log,
    capacity,
    console,
    deployments,
    health,
    keys,
    metrics,
    models,
    nodes,
    offerings,
    placement,
    residency,
    routers,
    routing,
    scaling,
    tenants,
    weights,
)
from control_plane.apidocs import router as api_docs
from control_plane.body_limit import BodyLimitMiddleware
from control_plane.console import router as console_shell
from control_plane.context import LEASE_THREADS, AppContext
from control_plane.db import migrate
from control_plane.db.engine import make_engine, make_sessionmakers
from control_plane.errors import register_error_handlers
from control_plane.fleet import fleet_loops
from control_plane.heartbeat_fast_path import HeartbeatFastPath
from control_plane.metrics import ControlPlaneMetrics
from control_plane.reaper import run_reaper
from control_plane.registration_gate import RegistrationAdmission
from control_plane.routing_table import NodeRows, build_routing_table, current_version
from control_plane.table_stream import TableStream
from control_plane.version_watch import VersionWatch
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import RoutingTable
from meridian.http_server import limited_config, problem_body
from meridian.logs import configure_logging
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.providers import ProviderSettings
from providers.catalog import load_catalog
from providers.onprem.inventory import load_inventory
from providers.regions import region_catalog

log = logging.getLogger(__name__)

# In-flight requests (long-polls included) get this long to finish on SIGTERM; routers
# and nodes keep their last snapshot and retry, so cutting a long-poll short is harmless.
GRACEFUL_SHUTDOWN_S = 5
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ensure_bootstrap_key(ctx: AppContext) -> None:
    secret = ctx.settings.bootstrap_admin_key
    if secret is None:
        return
    try:
        with ctx.write() as session:
            added = keystore.ensure_bootstrap_key(session, secret.get_secret_value(), ctx.clock.now())
    except IntegrityError:
        # Another control plane starting on the same database added it first.
        added = False
    if added:
        log.info("bootstrap admin key added")


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: ControlPlaneSettings = app.state.settings
    clock: Clock = app.state.clock
    await asyncio.to_thread(migrate.upgrade, settings.database_url)
    # One parse of the inventory, so the regions and the catalog agree on its sites.
    inventory = await asyncio.to_thread(load_inventory, settings.onprem_inventory)
    regions = region_catalog(inventory)
    catalog = await asyncio.to_thread(load_catalog, inventory)
    engine = make_engine(settings.database_url, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_max_overflow)
    try:
        reads, writes = make_sessionmakers(engine)

        def read_version() -> int:
            with reads() as session:
                return current_version(session)

        def build_table(known: NodeRows) -> RoutingTable:
            with reads() as session:
                return build_routing_table(session, regions, clock.now(), known)

        tables = TableStream(
            build_table,
            max_versions=settings.routing_history_versions,
            max_bytes=settings.routing_history_bytes,
            min_interval_s=settings.routing_build_min_interval_s,
            max_cpu_share=settings.routing_build_max_cpu_share,
            clock=clock,
        )
        ctx = AppContext(
            tables=tables,
            settings=settings,
            engine=engine,
            lease_engine=_lease_engine(settings.database_url, engine),
            read_sessions=reads,
            write_sessions=writes,
            regions=regions,
            catalog=catalog,
            provider_settings=app.state.provider_settings,
            watch=VersionWatch(read_version, asyncio.get_running_loop(), clock=clock),
            clock=clock,
        )
        await asyncio.to_thread(_ensure_bootstrap_key, ctx)
        app.state.ctx = ctx
        stop = asyncio.Event()
        reaper = asyncio.create_task(run_reaper(ctx, stop, app.state.metrics.observe_reaper),
                                     name="meridian-reaper")
        try:
            async with fleet_loops(ctx, app.state.metrics) as elector:
                app.state.elector = elector
                yield
        finally:
            stop.set()
            await reaper
            ctx.close()
    finally:
        engine.dispose()


def _lease_engine(url: str, shared: Engine) -> Engine | None:
    """Lease renewals' own pool on Postgres (see AppContext.lease_engine); SQLite has one writer
    whatever the pool, so renewals share its engine."""
    if shared.dialect.name != "postgresql":
        return None
    return make_engine(url, pool_size=LEASE_THREADS, max_overflow=0)


def create_app(
    settings: ControlPlaneSettings, *, clock: Clock = SYSTEM_CLOCK, providers: ProviderSettings | None = None
) -> FastAPI:
    """The control plane's ASGI app; start-up migrates the database and starts the reaper.

    `clock` is the time every part of it reads and its loops sleep on (tests: a ManualClock);
    `providers` the drivers the reconciler runs and the placement plans for (default: read from
    MERIDIAN_PROVIDER_*).
    """
    # /docs is served from the package (control_plane.apidocs), not FastAPI's CDN page; no ReDoc.
    app = FastAPI(
        title="Meridian control plane", version="0.1.0", lifespan=_lifespan, openapi_tags=openapi_doc.TAGS,
        docs_url=None, redoc_url=None, swagger_ui_oauth2_redirect_url=None,
    )
    app.state.settings = settings
    app.state.clock = clock
    app.state.provider_settings = providers or ProviderSettings()
    app.state.metrics = ControlPlaneMetrics()
    app.state.elector = None
    register_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    # Before the body limit: a registration refused under a storm costs no body read
    # (registration_gate).
    app.add_middleware(RegistrationAdmission)
    # Outermost: the unchanged heartbeat, nearly all of a large fleet's requests, skips the rest.
    app.add_middleware(HeartbeatFastPath)
    for module in (
        health, nodes, residency, routing, keys, tenants, deployments, models, capacity, offerings, placement,
        weights, audit_log, scaling, metrics, console, routers,
    ):
        app.include_router(module.router)
    app.include_router(console_shell)
    app.include_router(api_docs)
    openapi_doc.install(app)
    return app


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising SIGTERM/SIGINT after a graceful shutdown.

    uvicorn re-raises the signal once it has drained, which kills the process with it
    (or raises KeyboardInterrupt); a control plane that shut down cleanly exits 0.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Release the routing-table long-polls first: uvicorn waits for open requests, and
        # one held to its timeout would be cancelled (an ERROR and a traceback) instead.
        release_long_polls(self.config.app)
        await super().shutdown(sockets)


def release_long_polls(app: FastAPI) -> None:
    """Answer every open long-poll of `app` now (shutdown)."""
    ctx = getattr(app.state, "ctx", None)
    if ctx is not None:
        ctx.watch.close()


def serve(settings: ControlPlaneSettings, providers: ProviderSettings | None = None) -> None:
    """Run the control plane under uvicorn until SIGTERM/SIGINT (blocking)."""
    configure_logging()
    config = limited_config(
        create_app(settings, providers=providers),
        settings,
        problem_body,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        access_log=False,
    )
    server = _Server(config)
    server.run()
    if not server.started:
        raise SystemExit("control plane failed to start; see the log above")
