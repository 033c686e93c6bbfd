"""The router's public listener: uvicorn with the fabric's limits, serving the app.

One Config for `meridian router serve` and for the tests that serve a router as it runs in
production (listener limits, the WebSocket upgrade, HTTP/1.1 keep-alive behind a load
balancer); the admin listener (/metrics) joins it when a metrics port is set.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from meridian.cpus import worker_count
from meridian.http_server import limited_config, openai_error_body
from meridian.logs import configure_logging
from meridian.settings.router import RouterSettings

from .app import RouterState, create_app
from .observability.admin_listener import create_metrics_app, run_with_admin_listener
from .workers import WorkerSlot
from .workers.supervisor import Supervisor, reuseport_socket

# uvicorn waits this long for open streams to finish on SIGTERM before cutting them.
_SHUTDOWN_GRACE_S = 30


def listener_config(app: FastAPI, settings: RouterSettings, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config of the router's public listener (serve's; tests serve with it too,
    overriding what they must in `kwargs`)."""
    options: dict[str, Any] = {
        "lifespan": "on",
        "timeout_graceful_shutdown": _SHUTDOWN_GRACE_S,
        # uvicorn's access line knows none of the request's routing: the router writes its
        # own (geo_router.observability.access_log, MERIDIAN_ROUTER_ACCESS_LOG).
        "access_log": False,
        "server_header": False,
        # The router reads X-Forwarded-For itself, trusting only settings.trusted_proxies
        # (ClientLocator); uvicorn's own rewrite would trust 127.0.0.1 on top of that.
        "proxy_headers": False,
        # WebSocket mode (geo_router.ingress.websocket): a message is at most a request body, and
        # pings find a peer that vanished without closing.
        "ws": "websockets-sansio",
        "ws_max_size": settings.max_request_bytes,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
    }
    if settings.tls_cert_file and settings.tls_key_file:
        # The same certificate as the gRPC listener's (geo_router.ingress.kserve.server).
        options |= {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
    if settings.http2_enabled:
        options["http2_max_streams"] = settings.http2_max_streams_per_connection
    return limited_config(app, settings, openai_error_body, **(options | kwargs))


def serve(settings: RouterSettings) -> None:
    """Run the router until SIGTERM/SIGINT: in this process, or as `settings.workers`
    processes on one port (geo_router.workers; 0: one per core)."""
    count = worker_count(settings.workers)
    if count == 1:
        run_router(settings)  # which sets up its own process's logging
        return
    configure_logging()
    status = Supervisor(settings, count, grace_s=_SHUTDOWN_GRACE_S).run()
    if status:
        raise SystemExit(status)


class _Server(uvicorn.Server):
    """uvicorn's Server that says when it listens (a worker tells its supervisor)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()


def run_router(settings: RouterSettings, slot: WorkerSlot | None = None, *,
               on_ready: Callable[[], None] | None = None) -> None:
    """One router process: the whole router, or worker `slot` of several (which then listens
    on sockets of its own bound with SO_REUSEPORT, and shares what geo_router.workers says).
    `on_ready`: called once the public listener listens."""
    configure_logging()
    config = listener_config(
        create_app(settings, worker=slot),
        settings,
        host=settings.host,
        port=settings.port,
        # The fast C implementations (uvicorn[standard]); named so that a missing one fails
        # at start-up instead of silently costing every request (the protocol is httptools').
        loop="uvloop",
    )
    server = _Server(config, on_ready)
    sockets = None if slot is None else [reuseport_socket(settings.host, settings.port)]
    if settings.metrics_port is None:
        server.run(sockets)
        return
    state: RouterState = config.app.state.router
    metrics_app = create_metrics_app(settings, state.metrics, state.prober, slot)
    run_with_admin_listener(server, metrics_app, settings, sockets)
