"""`meridian node run`: serve a checkpoint under uvicorn, draining gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from types import FrameType

import uvicorn

from data_plane.runtime import NodeRuntime
from data_plane.server.app import create_app
from meridian.http_server import limited_config, openai_error_body
from meridian.logs import configure_logging
from meridian.settings.node import NodeSettings

log = logging.getLogger(__name__)

# After the drain, streams that outlived drain_timeout_s get this long before uvicorn
# cuts their connections.
SHUTDOWN_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains the node before exiting.

    uvicorn's own handler stops accepting connections at once and re-raises the
    signal after shutdown (exit status 143). Here the first signal only starts the
    drain: the node keeps answering (503 to new work, /health 503) while in-flight
    requests finish, and the process then exits normally with status 0. A second
    signal exits immediately.
    """

    def __init__(self, config: uvicorn.Config, runtime: NodeRuntime) -> None:
        super().__init__(config)
        self._runtime = runtime
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit_requested = False
        self._drain_task: asyncio.Task[None] | None = None
        self.failed = False
        runtime.on_fatal = self._on_fatal

    def _on_fatal(self, exc: BaseException) -> None:
        # Nothing to drain: the model never loaded. Exit so a supervisor can restart us.
        self.failed = True
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._exit_requested or self._loop is None:
            self.should_exit = True
            self.force_exit = True
            return
        self._exit_requested = True
        log.info("received signal %d: draining before exit", sig)
        # Signal handlers run between bytecodes of the loop's thread: hand over to the loop.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._runtime.drain()
        except Exception:
            log.exception("drain failed; exiting anyway")
        finally:
            self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket up front, so port 0 resolves before registration."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(settings: NodeSettings) -> None:
    """Load the checkpoint, serve it until SIGTERM/SIGINT, drain, and return."""
    if settings.model_dir is None and settings.model_uri is None:
        raise ValueError("a node needs model_dir or model_uri")
    configure_logging()
    sock = bind_socket(settings.host, settings.port)
    settings = settings.model_copy(update={"port": sock.getsockname()[1]})
    app = create_app(settings)
    config = limited_config(
        app,
        settings,
        openai_error_body,
        lifespan="on",
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
    )
    server = DrainingServer(config, app.state.runtime)
    log.info("node listening on %s:%d", settings.host, settings.port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.failed or not server.started:
        # The model did not load or the lifespan failed; the cause was logged.
        sys.exit(1)
