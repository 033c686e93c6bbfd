"""The supervisor of `meridian router serve --workers N`: starts, replaces and stops workers.

- It reserves the public (and metrics) port first. A plain bind finds any holder (another
  router's SO_REUSEPORT workers included, which would otherwise share the port silently) and
  fails at once with a clear message; then a socket bound with SO_REUSEPORT that never listens
  holds the port (port 0 resolved to one port for every worker; the kernel routes no
  connection to a socket that does not listen).
- Each worker is a spawned process (a fresh interpreter: no state inherited from this one)
  running the whole router on its own sockets bound to the same port (geo_router.listener).
- A worker that exits is replaced. One that dies within _MIN_UPTIME_S of starting is
  restarted after a backoff that doubles up to _MAX_BACKOFF_S, so a crash loop does not spin;
  one that exits on its very first start before it could serve (a bad setting, an unreadable
  certificate) stops the router with its exit code, since its siblings would fail the same way.
- SIGTERM or SIGINT: every worker is sent SIGTERM and given the listener's grace to finish its
  streams, then killed. A worker's parent-death signal is SIGTERM, so a supervisor killed
  outright does not leave orphans serving.

The private state directory (mode 0700) holds what the workers share on the host
(geo_router.workers: the bucket table, the rings, the metrics sockets) and is removed on exit.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

from meridian.settings.router import RouterSettings

from . import WorkerSlot
from .host_buckets import BucketTable
from .host_fleet import create_ring as create_fleet_ring
from .host_history import create_ring as create_history_ring
from .host_probes import create_ring as create_probe_ring

log = logging.getLogger(__name__)

# A worker that lived less than this crashed at start-up: its restart backs off.
_MIN_UPTIME_S = 5.0
_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 30.0
# Beyond the listener's own grace (geo_router.listener), before a stopping worker is killed.
_STOP_SLACK_S = 5.0
_PR_SET_PDEATHSIG = 1


def _tcp_socket(host: str, port: int) -> tuple[socket.socket, Any]:
    """A new TCP socket for host:port, and the address to bind it to."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    return socket.socket(family, kind, proto), address


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT (not listening yet)."""
    sock, address = _tcp_socket(host, port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _exclusive_port(host: str, port: int) -> int:
    """`port` (or with 0 a free one) if nothing else holds it, SO_REUSEPORT listeners included.

    SO_REUSEPORT would let a second router of the same user join this one's port and take half
    its connections instead of failing: a plain bind first finds any holder."""
    probe, address = _tcp_socket(host, port)
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        return int(probe.getsockname()[1])


@dataclass
class _Worker:
    slot: WorkerSlot
    process: BaseProcess | None = None
    # Set by the worker once it listens (geo_router.listener.run_router).
    ready: EventType | None = None
    started_at: float = 0.0
    starts: int = 0
    backoff_s: float = _FIRST_BACKOFF_S
    restart_at: float | None = None


@dataclass
class Supervisor:
    """Runs `count` workers of the router of `settings` until SIGTERM/SIGINT."""

    settings: RouterSettings
    count: int
    grace_s: float
    _workers: list[_Worker] = field(default_factory=list)

    def run(self) -> int:
        """Serve until told to stop; the exit status."""
        state_dir = Path(tempfile.mkdtemp(prefix="meridian-router-"))
        wake_read, wake_write = socket.socketpair()
        reserved: list[socket.socket] = []
        try:
            settings = self._reserve_ports(reserved)
            shared = WorkerSlot(0, self.count, state_dir)
            BucketTable.create(shared.buckets_path)
            create_history_ring(shared.history_path)
            create_fleet_ring(shared.fleet_path)
            create_probe_ring(shared.probes_path)
            self._workers = [_Worker(WorkerSlot(i, self.count, state_dir)) for i in range(self.count)]
            wake_write.setblocking(False)
            previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
            old_fd = signal.set_wakeup_fd(wake_write.fileno())
            try:
                log.info("router: %d workers on %s:%d", self.count, settings.host, settings.port)
                return self._supervise(settings, wake_read)
            finally:
                self._stop_all()
                signal.set_wakeup_fd(old_fd)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        finally:
            for sock in (*reserved, wake_read, wake_write):
                sock.close()
            shutil.rmtree(state_dir, ignore_errors=True)

    def _reserve_ports(self, reserved: list[socket.socket]) -> RouterSettings:
        """Bind the ports (SystemExit when taken); the settings with port 0 resolved."""
        update: dict[str, int] = {}
        ports = [("port", self.settings.host, self.settings.port)]
        if self.settings.metrics_port is not None:
            ports.append(("metrics_port", self.settings.metrics_host, self.settings.metrics_port))
        for name, host, port in ports:
            try:
                bound = _exclusive_port(host, port)
                reserved.append(reuseport_socket(host, bound))
            except OSError as exc:
                raise SystemExit(f"router: cannot listen on {host}:{port}: {exc.strerror}") from exc
            update[name] = bound
        return self.settings.model_copy(update=update)

    def _supervise(self, settings: RouterSettings, wake: socket.socket) -> int:
        for worker in self._workers:
            self._start(worker, settings)
        while True:
            now = time.monotonic()
            for worker in self._workers:
                if worker.restart_at is not None and now >= worker.restart_at:
                    self._start(worker, settings)
            sentinels = [w.process.sentinel for w in self._workers if w.process is not None]
            ready = wait([wake, *sentinels], timeout=self._next_wake_s(now))
            if wake in ready:
                return 0
            for worker in self._workers:
                status = self._reap(worker)
                if status is not None:
                    return status

    def _start(self, worker: _Worker, settings: RouterSettings) -> None:
        context = multiprocessing.get_context("spawn")
        worker.ready = context.Event()
        process = context.Process(target=run_worker, args=(settings, worker.slot, worker.ready),
                                  name=f"meridian-router-worker-{worker.slot.index}")
        process.start()
        worker.process, worker.started_at, worker.restart_at = process, time.monotonic(), None
        worker.starts += 1

    def _reap(self, worker: _Worker) -> int | None:
        """Schedule the replacement of a worker that exited; an exit status to stop with."""
        process = worker.process
        if process is None or process.exitcode is None:
            return None
        worker.process = None
        lived_s = time.monotonic() - worker.started_at
        code = process.exitcode
        if worker.starts == 1 and worker.ready is not None and not worker.ready.is_set():
            log.error("router worker %d exited before it could serve (code %s): stopping",
                      worker.slot.index, code)
            return code if code > 0 else 1
        if lived_s < _MIN_UPTIME_S:
            delay, worker.backoff_s = worker.backoff_s, min(_MAX_BACKOFF_S, worker.backoff_s * 2)
        else:
            delay, worker.backoff_s = 0.0, _FIRST_BACKOFF_S
        log.warning("router worker %d exited (code %s) after %.1f s: replacing it in %.1f s",
                    worker.slot.index, code, lived_s, delay)
        worker.restart_at = time.monotonic() + delay
        return None

    def _next_wake_s(self, now: float) -> float | None:
        pending = [w.restart_at for w in self._workers if w.restart_at is not None]
        return max(0.0, min(pending) - now) if pending else None

    def _stop_all(self) -> None:
        live = [w.process for w in self._workers if w.process is not None and w.process.is_alive()]
        for process in live:
            process.terminate()
        deadline = time.monotonic() + self.grace_s + _STOP_SLACK_S
        for process in live:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("router worker %s did not stop within its grace: killing it", process.name)
                process.kill()
                process.join()


def run_worker(settings: RouterSettings, slot: WorkerSlot, ready: EventType) -> None:
    """A worker process's main: the router on its own SO_REUSEPORT sockets."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    from ..listener import run_router

    run_router(settings, slot, on_ready=ready.set)
