"""Run `vllm serve` as a supervised child: start, readiness, liveness, restart, stop.

The child runs in its own session (process group), so stopping or reaping it also ends
the engine-core and worker processes vLLM spawns, which would otherwise keep the GPUs.
Its stdout and stderr are forwarded line by line to the `data_plane.engine.vllm.child`
logger. A child that exits (or stops answering /health) is restarted after an
exponential backoff with jitter; more than `max_restarts` exits within `window_s` and
the supervisor gives up and reports failure.

The restart backoff and window, the startup timeout and the stop grace period run on the
supervisor's `Clock` (the node's), so tests move time instead of sleeping through them.
The probe cadence stays on the event loop's time: it polls a real process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import httpx

from meridian.backoff import Backoff
from meridian.clock import SYSTEM_CLOCK, Clock, wait_at_most

log = logging.getLogger(__name__)
child_log = logging.getLogger("data_plane.engine.vllm.child")

# Lines of the child's output kept to explain a failure.
_TAIL_LINES = 40
# Longest line read from the child (tracebacks can carry huge reprs).
_LINE_LIMIT = 1 << 20


class ChildState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    FAILED = "failed"


class VllmFailedError(RuntimeError):
    """vLLM could not be started, or kept dying: the supervisor gave up."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Bounded restarts with exponential backoff and jitter."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 2.0
    backoff_max_s: float = 60.0
    # Each delay is scaled by a random factor in [1 - jitter, 1 + jitter], so that the
    # nodes of a fleet hit by the same fault do not restart in lockstep.
    jitter: float = 0.2

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait before the next start, after `failures` recent exits (>= 1)."""
        return Backoff(self.backoff_s, self.backoff_max_s, jitter=self.jitter).delay(failures, rand)


class VllmSupervisor:
    """Keeps one `vllm serve` process running and tells its owner when it is usable.

    `on_ready(generation)` runs each time a child becomes ready, `on_exit(generation,
    returncode)` each time one ends (expected or not) and `on_failed(error)` once, when
    the supervisor gives up. All run on the event loop.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        base_url: str,
        served_model_name: str,
        startup_timeout_s: float = 1800.0,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 5.0,
        liveness_failures: int = 3,
        stop_grace_s: float = 30.0,
        policy: RestartPolicy | None = None,
        env: Mapping[str, str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.argv = list(argv)
        self._clock = clock
        self.base_url = base_url.rstrip("/")
        self.served_model_name = served_model_name
        self._startup_timeout_s = startup_timeout_s
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._liveness_failures = liveness_failures
        self._stop_grace_s = stop_grace_s
        self.policy = policy or RestartPolicy()
        self._env = {**os.environ, **(env or {})}
        self.on_ready: Callable[[int], None] | None = None
        self.on_exit: Callable[[int, int | None], None] | None = None
        self.on_failed: Callable[[BaseException], None] | None = None
        self.state = ChildState.STOPPED
        # Increments at every start; lets the owner tell one child's events from the next's.
        self.generation = 0
        self.restarts = 0
        self.error: VllmFailedError | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._stopping = asyncio.Event()

    # --- public --------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Process id of the running child (also its process group id)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    @property
    def ready(self) -> bool:
        return self.state is ChildState.READY

    async def start(self) -> None:
        """Start vLLM and wait until it serves the model; raises VllmFailedError on giving up."""
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._supervise(), name="vllm-supervisor")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self.state is not ChildState.READY:
            await self.stop()
            raise self.error or VllmFailedError("vLLM stopped while starting")

    async def wait_ready(self) -> None:
        """Wait until a child is ready again (after a restart); raises if supervision ended."""
        while self.state is not ChildState.READY:
            if self._task is None or self._task.done():
                raise self.error or VllmFailedError("vLLM is not running")
            ready = asyncio.create_task(self._ready.wait())
            try:
                await asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()

    async def stop(self) -> None:
        """SIGTERM the child's process group, SIGKILL it after the grace period, stop supervising."""
        self._stopping.set()
        # The supervision loop notices, terminates the child and returns.
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.state is not ChildState.FAILED:
            self.state = ChildState.STOPPED

    def kill(self) -> None:
        """SIGKILL the current child (it is then restarted like after a crash)."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            _signal_group(proc.pid, signal.SIGKILL)

    def output_tail(self) -> list[str]:
        """The last lines the child printed."""
        return list(self._tail)

    # --- supervision loop ------------------------------------------------------------------

    async def _supervise(self) -> None:
        exits: deque[float] = deque()
        while not self._stopping.is_set():
            self.generation += 1
            generation = self.generation
            self.state = ChildState.STARTING
            try:
                proc = await self._spawn()
            except OSError as exc:
                # A missing or non-executable program will not fix itself.
                self._give_up(VllmFailedError(f"cannot run {self.argv[0]!r}: {exc}"))
                return
            pumps = [asyncio.create_task(self._pump(proc.stdout, logging.INFO)),
                     asyncio.create_task(self._pump(proc.stderr, logging.INFO))]
            reason = ""
            try:
                reason = await self._wait_ready(proc)
                if not reason:
                    self.state = ChildState.READY
                    self._ready.set()
                    log.info("vLLM ready (pid %d, generation %d) at %s", proc.pid, generation, self.base_url)
                    if self.on_ready is not None:
                        self.on_ready(generation)
                    reason = await self._watch(proc)
            finally:
                self._ready.clear()
                # A hung child is killed at once; one being stopped gets its grace period.
                hung = bool(reason) and not self._stopping.is_set()
                await self._terminate(proc, 0.0 if hung else self._stop_grace_s)
                # The leader is gone; its engine-core and workers must not outlive it.
                _signal_group(proc.pid, signal.SIGKILL)
                await _finish_pumps(pumps)
                if self.on_exit is not None:
                    self.on_exit(generation, proc.returncode)
            if self._stopping.is_set():
                return
            now = self._clock.monotonic()
            exits.append(now)
            while exits and exits[0] < now - self.policy.window_s:
                exits.popleft()
            detail = reason or f"exit code {proc.returncode}"
            if len(exits) > self.policy.max_restarts:
                self._give_up(VllmFailedError(
                    f"vLLM failed {len(exits)} times within {self.policy.window_s:.0f}s "
                    f"(last: {detail}); giving up. Last output:\n" + "\n".join(self._tail)
                ))
                return
            delay = self.policy.delay(len(exits))
            log.warning("vLLM (generation %d) ended: %s; restarting in %.2fs", generation, detail, delay)
            self.state = ChildState.BACKOFF
            await wait_at_most(self._clock, delay, self._stopping.wait())
            if self._stopping.is_set():
                return
            self.restarts += 1

    def _give_up(self, error: VllmFailedError) -> None:
        log.error("%s", error)
        self.error = error
        self.state = ChildState.FAILED
        if self.on_failed is not None:
            self.on_failed(error)

    async def _spawn(self) -> asyncio.subprocess.Process:
        log.info("starting vLLM: %s", " ".join(self.argv))
        self._tail.clear()
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._env,
            start_new_session=True,
            limit=_LINE_LIMIT,
        )
        self._proc = proc
        return proc

    async def _pump(self, stream: asyncio.StreamReader | None, level: int) -> None:
        if stream is None:
            return
        while True:
            try:
                raw = await stream.readline()
            except ValueError:
                # Longer than the limit: take what is buffered and go on.
                raw = await stream.read(_LINE_LIMIT)
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._tail.append(line)
                child_log.log(level, "%s", line)

    async def _probe(self, client: httpx.AsyncClient, *, models: bool) -> bool:
        try:
            health = await client.get("/health")
            if health.status_code != 200:
                return False
            if not models:
                return True
            listed = await client.get("/v1/models")
            if listed.status_code != 200:
                return False
            ids = {m.get("id") for m in listed.json().get("data", []) if isinstance(m, dict)}
            return self.served_model_name in ids
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> str:
        """'' once /health answers and /v1/models lists the model; else why not."""
        deadline = self._clock.monotonic() + self._startup_timeout_s
        exited = asyncio.create_task(proc.wait())
        try:
            async with self._client() as client:
                while True:
                    if self._stopping.is_set():
                        return "stopped"
                    if exited.done():
                        return f"exited with code {proc.returncode} while starting"
                    if await self._probe(client, models=True):
                        return ""
                    remaining = deadline - self._clock.monotonic()
                    if remaining <= 0:
                        return f"not ready after {self._startup_timeout_s:.0f}s"
                    stop = asyncio.create_task(self._stopping.wait())
                    try:
                        await asyncio.wait({exited, stop}, timeout=min(self._probe_interval_s, remaining))
                    finally:
                        stop.cancel()
        finally:
            exited.cancel()

    async def _watch(self, proc: asyncio.subprocess.Process) -> str:
        """Wait for the child to exit, stop or hang; '' for an exit, else why it is killed."""
        exited = asyncio.create_task(proc.wait())
        failures = 0
        try:
            async with self._client() as client:
                while True:
                    stop = asyncio.create_task(self._stopping.wait())
                    try:
                        await asyncio.wait({exited, stop}, timeout=self._probe_interval_s,
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stop.cancel()
                    if exited.done():
                        return ""
                    if self._stopping.is_set():
                        return ""
                    if await self._probe(client, models=False):
                        failures = 0
                        continue
                    failures += 1
                    if failures >= self._liveness_failures:
                        return f"/health failed {failures} times in a row"
        finally:
            exited.cancel()

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=self._probe_timeout_s)

    async def _terminate(self, proc: asyncio.subprocess.Process, grace_s: float) -> None:
        if proc.returncode is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        if await wait_at_most(self._clock, grace_s, proc.wait()):
            return
        log.warning("vLLM (pid %d) still running %.0fs after SIGTERM: killing it", proc.pid, grace_s)
        _signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _finish_pumps(pumps: list[asyncio.Task[None]]) -> None:
    # Output already written is still read; a descendant that kept the pipe open
    # (it was just SIGKILLed with the group) must not hold us up.
    done, pending = await asyncio.wait(pumps, timeout=5.0)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
