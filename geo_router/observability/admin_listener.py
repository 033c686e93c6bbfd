"""Where the router's /metrics is served: its labels name tenants and nodes, so never to
anyone on the public port.

- `metrics_port` unset (default): /metrics on the public port answers only a bearer of the
  router's `metrics_token` or the cluster token (401 otherwise), as before.
- `metrics_port` set: a second, small listener on `metrics_host:metrics_port` (default
  host 127.0.0.1: bind it to an internal interface only) serves /metrics, with the same
  listener limits as the public one (meridian.http_server), and answers a bearer of
  `metrics_token` only when one is set (else anyone who can reach the port). The public
  port then has no /metrics at all (404), so nothing of it is reachable from outside.

Both listeners run in one process and one event loop; the admin one is stopped when the
public one has shut down, and never handles signals itself. With several workers
(geo_router.workers) each worker runs both on SO_REUSEPORT sockets, and whichever is scraped
answers with every worker's series (geo_router.workers.metrics_pages).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import SecretStr

from meridian.http_server import limited_config, openai_error_body
from meridian.security import bearer_token, constant_time_equals
from meridian.settings.router import RouterSettings

from ..errors import InvalidApiKey, install_error_handlers
from ..state.probe import NodeProber
from ..workers import WorkerSlot
from ..workers.metrics_pages import gathered_page
from ..workers.supervisor import reuseport_socket
from .metrics import RouterMetrics

# How long the admin listener may take to bind before the router gives up starting.
_START_TIMEOUT_S = 10.0


def scraper_tokens(*tokens: SecretStr | None) -> list[str]:
    return [t.get_secret_value() for t in tokens if t is not None]


def own_page(metrics: RouterMetrics, prober: NodeProber) -> bytes:
    """This process's Prometheus page."""
    metrics.set_reported_cache(prober.loads())
    return metrics.render()


async def metrics_page(request: Request, metrics: RouterMetrics, prober: NodeProber, tokens: Sequence[str],
                       worker: WorkerSlot | None = None) -> Response:
    """The Prometheus page for a bearer of one of `tokens` (anyone when there are none): of
    this process, or with `worker` of every worker of the router (geo_router.workers)."""
    if tokens:
        token = bearer_token(request.headers.get("authorization"))
        if token is None or not any(constant_time_equals(token, t) for t in tokens):
            raise InvalidApiKey("/metrics needs the router's metrics token or the cluster token.")
    page = own_page(metrics, prober)
    if worker is not None:
        page = await gathered_page(worker, page)
    return Response(page, media_type=CONTENT_TYPE_LATEST)


def create_metrics_app(settings: RouterSettings, metrics: RouterMetrics, prober: NodeProber,
                       worker: WorkerSlot | None = None) -> FastAPI:
    """The admin listener's app: GET /metrics only (guarded by `metrics_token` when set)."""
    app = FastAPI(title="Meridian geo router (metrics)", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    tokens = scraper_tokens(settings.metrics_token)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        return await metrics_page(request, metrics, prober, tokens, worker)

    return app


class _AdminServer(uvicorn.Server):
    """The admin listener: the public server handles the signals and stops it after itself."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready.set()


def admin_config(settings: RouterSettings, app: FastAPI) -> uvicorn.Config:
    assert settings.metrics_port is not None
    return limited_config(app, settings, openai_error_body, host=settings.metrics_host, port=settings.metrics_port,
                          lifespan="off", access_log=False, server_header=False,
                          timeout_graceful_shutdown=2)


def run_with_admin_listener(public: uvicorn.Server, admin_app: FastAPI, settings: RouterSettings,
                            sockets: list[socket.socket] | None = None) -> None:
    """Serve the public server and the admin listener until the public one stops (SIGTERM).
    `sockets`: the public listener's own (a worker's); the admin one then binds its port with
    SO_REUSEPORT too."""
    admin = _AdminServer(admin_config(settings, admin_app))
    admin_sockets = None
    if sockets is not None:
        assert settings.metrics_port is not None
        admin_sockets = [reuseport_socket(settings.metrics_host, settings.metrics_port)]

    async def both() -> None:
        task = asyncio.create_task(admin.serve(admin_sockets), name="router-admin-listener")
        ready = asyncio.create_task(admin.ready.wait())
        # A listener that cannot bind ends its task instead of becoming ready.
        await asyncio.wait((ready, task), timeout=_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if not admin.started:
            raise SystemExit(f"router: cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}")
        try:
            await public.serve(sockets)
        finally:
            admin.should_exit = True
            await task

    with asyncio.Runner(loop_factory=public.config.get_loop_factory()) as runner:
        runner.run(both())
