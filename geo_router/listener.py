"""The router's public listener: uvicorn with the fabric's limits, serving the app.

One Config for `meridian router serve` and for the tests that serve a router as it runs in
production (listener limits, the WebSocket upgrade, HTTP/1.1 keep-alive behind a load
balancer); the admin listener (/metrics) joins it when a metrics port is set.
"""

from __future__ import annotations

from typing import Any

import uvicorn
from fastapi import FastAPI

from meridian.http_server import limited_config, openai_error_body
from meridian.logs import configure_logging
from meridian.settings import RouterSettings

from .admin_listener import create_metrics_app, run_with_admin_listener
from .app import RouterState, create_app

# uvicorn waits this long for open streams to finish on SIGTERM before cutting them.
_SHUTDOWN_GRACE_S = 30


def listener_config(app: FastAPI, settings: RouterSettings, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config of the router's public listener (serve's; tests serve with it too,
    overriding what they must in `kwargs`)."""
    options: dict[str, Any] = {
        "lifespan": "on",
        "timeout_graceful_shutdown": _SHUTDOWN_GRACE_S,
        # uvicorn's access line knows none of the request's routing: the router writes its
        # own (geo_router.access_log, MERIDIAN_ROUTER_ACCESS_LOG).
        "access_log": False,
        "server_header": False,
        # The router reads X-Forwarded-For itself, trusting only settings.trusted_proxies
        # (ClientLocator); uvicorn's own rewrite would trust 127.0.0.1 on top of that.
        "proxy_headers": False,
        # Longer than the idle timeout of the load balancers that usually sit in front (60 s
        # on AWS ALB and GCP), so that they, not the router, close idle connections: the
        # other way round, a request sent as the router closes gets a 502.
        "timeout_keep_alive": 75,
        # WebSocket mode (geo_router.websocket): a message is at most a request body, and
        # pings find a peer that vanished without closing.
        "ws": "websockets-sansio",
        "ws_max_size": settings.max_request_bytes,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
    }
    if settings.tls_cert_file and settings.tls_key_file:
        # The same certificate as the gRPC listener's (geo_router.kserve.server).
        options |= {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
    if settings.http2_enabled:
        options["http2_max_streams"] = settings.http2_max_streams_per_connection
    return limited_config(app, settings, openai_error_body, **(options | kwargs))


def serve(settings: RouterSettings) -> None:
    """Run the router under uvicorn until SIGTERM/SIGINT."""
    configure_logging()
    config = listener_config(
        create_app(settings),
        settings,
        host=settings.host,
        port=settings.port,
        # The fast C implementations (uvicorn[standard]); named so that a missing one fails
        # at start-up instead of silently costing every request (the protocol is httptools').
        loop="uvloop",
    )
    server = uvicorn.Server(config)
    if settings.metrics_port is None:
        server.run()
        return
    state: RouterState = config.app.state.router
    run_with_admin_listener(server, create_metrics_app(settings, state.metrics, state.prober), settings)
