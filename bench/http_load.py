"""The router bench's load generator: raw keep-alive HTTP/1.1 connections on uvloop,
answers parsed with httptools, latency measured at the client (bench/router.py says why).

Open loop (`open_loop`): requests go out on schedule at a fixed rate whether or not earlier
ones were answered, each timed from when it was due, on up to MAX_IN_FLIGHT connections;
answers still missing DRAIN_S after the last request count with the time waited so far.
Closed loop (`closed_loop`): N connections each sending the next request as soon as the
previous one is answered, for the maximum throughput; `saturate` adds the CPU the target's
processes spent per request meanwhile (its process group's, from /proc). `wait_idle` waits between phases
until the proxy's processes have worked off their backlog. A module of its own, apart from
the bench's set-up (node, proxies, figures): it knows nothing of Meridian, only a port and
the bytes of one request.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import cast

import httptools

# Requests in flight per path at most: more wait in the client, timed from when they were
# due, so a path that cannot keep up shows it without being buried under a backlog.
MAX_IN_FLIGHT = 128
# An open-loop phase waits at most this long for its last answers; those still missing
# count with the time waited so far (so percentiles are then lower bounds).
DRAIN_S = 5.0
# After each phase, wait (at most this long) until the proxy has worked off its backlog.
IDLE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Target:
    """One path under test: where to connect, the request bytes to send, and the process
    group of the proxy (to wait for it to go idle between phases; None: not needed)."""

    name: str
    port: int
    request: bytes = field(repr=False)
    pgid: int | None = None


def post_target(name: str, port: int, route: str, body: bytes, api_key: str, pgid: int | None = None) -> Target:
    """A Target that POSTs `body` (JSON) to `route` on loopback `port` with a bearer key."""
    head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return Target(name, port, head.encode() + body, pgid)


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds used so far by the processes of a process group."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def wait_idle(target: Target) -> None:
    """Wait until the proxy uses under 10% of a CPU (a backlog left by the last phase is done)."""
    if target.pgid is None:
        return
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    before = _group_cpu_s(target.pgid)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = _group_cpu_s(target.pgid)
        if now - before < 0.025:
            return
        before = now


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection carrying one request at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[int] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio subclasses

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)
            self.close()

    def on_message_complete(self) -> None:
        if not self._parser.should_keep_alive():
            self.close()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self._parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def send(self, request: bytes) -> asyncio.Future[int]:
        """Write `request`; the future gets the response's status code."""
        assert self._transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


class _Pool:
    """Keep-alive connections to one port, at most `limit` open; waiters are served in turn."""

    def __init__(self, port: int, limit: int) -> None:
        self._port = port
        self._limit = limit
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        conn = _Conn()
        self._all.add(conn)
        try:
            await loop.create_connection(lambda: conn, "127.0.0.1", self._port)
        except BaseException:
            self._all.discard(conn)
            raise
        return conn

    async def fill(self, n: int) -> None:
        for conn in await asyncio.gather(*(self._connect() for _ in range(min(n, self._limit)))):
            self._idle.append(conn)

    async def acquire(self) -> _Conn:
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    return conn
                self._all.discard(conn)
            if len(self._all) < self._limit:
                return await self._connect()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def release(self, conn: _Conn) -> None:
        if conn.closed:
            self._all.discard(conn)
        else:
            self._idle.append(conn)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def close(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._idle.clear()


@dataclass
class LatencyRun:
    latencies_ms: list[float]  # the unanswered included, as lower bounds
    errors: int  # error answers and broken connections
    unanswered: int  # still waiting when the phase ended
    sent: int


async def open_loop(target: Target, rate: float, seconds: float, warmup_s: float,
                    max_in_flight: int = MAX_IN_FLIGHT, drain_s: float = DRAIN_S) -> LatencyRun:
    """Send at a fixed `rate` for warmup_s + seconds; latencies of the requests after the warm-up."""
    loop = asyncio.get_running_loop()
    pool = _Pool(target.port, max_in_flight)
    await pool.fill(16)
    n_warm = int(rate * warmup_s)
    n = n_warm + int(rate * seconds)
    latencies: list[float] = []
    waiting: dict[int, float] = {}  # measured requests not answered yet: their start
    errors = 0

    async def one(i: int, t0: float) -> None:
        nonlocal errors
        try:
            conn = await pool.acquire()
        except OSError:
            errors += 1
            return
        try:
            status = await conn.send(target.request)
        except (OSError, httptools.HttpParserError):
            errors += 1
            return
        finally:
            pool.release(conn)
            waiting.pop(i, None)
        if status != 200:
            errors += 1
        elif i >= n_warm:
            latencies.append((time.perf_counter() - t0) * 1000.0)

    tasks: list[asyncio.Task[None]] = []
    start = loop.time() + 0.005
    for i in range(n):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        # Timed from when it is due to go out, so any wait for a free connection counts.
        t0 = time.perf_counter()
        if i >= n_warm:
            waiting[i] = t0
        tasks.append(loop.create_task(one(i, t0)))
    _, pending = await asyncio.wait(tasks, timeout=drain_s)
    cutoff = time.perf_counter()
    latencies += [(cutoff - t0) * 1000.0 for t0 in waiting.values()]
    unanswered = len(waiting)
    for t in pending:
        t.cancel()
    pool.close()
    return LatencyRun(latencies, errors, unanswered, n - n_warm)


@dataclass(frozen=True)
class Saturation:
    """A closed-loop phase: requests/s answered, errors, and the CPU the target's processes
    spent per answered request over the counted window (None without a process group)."""

    rps: float
    errors: int
    cpu_per_request_ms: float | None


async def cpu_over_window(pgid: int, warmup_s: float, seconds: float) -> float:
    """CPU seconds the process group `pgid` spends from `warmup_s` from now for `seconds`:
    the counted window of a load phase, its warm-up and drain left out."""
    await asyncio.sleep(warmup_s)
    before = _group_cpu_s(pgid)
    await asyncio.sleep(seconds)
    return _group_cpu_s(pgid) - before


async def saturate(target: Target, concurrency: int, seconds: float, warmup_s: float) -> Saturation:
    """`closed_loop`, with the target's CPU per request while it was saturated."""
    if target.pgid is None:
        rps, errors = await closed_loop(target, concurrency, seconds, warmup_s)
        return Saturation(rps, errors, None)
    cpu_s, (rps, errors) = await asyncio.gather(cpu_over_window(target.pgid, warmup_s, seconds),
                                                closed_loop(target, concurrency, seconds, warmup_s))
    return Saturation(rps, errors, cpu_s / (rps * seconds) * 1000 if rps > 0 else None)


async def saturate_rounds(targets: list[Target], rounds: int, concurrency: int, seconds: float,
                          warmup_s: float = 0.5) -> dict[str, list[Saturation]]:
    """`saturate` each target in turn, `rounds` times, the order rotated every round (each
    target goes first as often), the targets idle again between phases. A phase with a failed
    request ends the run: a rate that counts errors is no figure."""
    out: dict[str, list[Saturation]] = {t.name: [] for t in targets}
    for r in range(rounds):
        shift = r % len(targets)
        for t in targets[shift:] + targets[:shift]:
            sat = await saturate(t, concurrency, seconds, warmup_s)
            if sat.errors or sat.cpu_per_request_ms is None:
                raise AssertionError(f"{t.name}: {sat.errors} failed requests")
            out[t.name].append(sat)
            print(f"# round {r + 1} {t.name}: {sat.cpu_per_request_ms:.4f} ms CPU per request, {sat.rps:.0f} req/s",
                  file=sys.stderr, flush=True)
            await wait_idle(t)
    return out


async def closed_loop(target: Target, concurrency: int, seconds: float, warmup_s: float) -> tuple[float, int]:
    """Requests/s answered with `concurrency` back-to-back clients over `seconds` (after a warm-up)."""
    pool = _Pool(target.port, concurrency)
    await pool.fill(concurrency)
    begin = time.perf_counter() + warmup_s
    end = begin + seconds
    done = 0
    errors = 0

    async def client() -> None:
        nonlocal done, errors
        conn = await pool.acquire()
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            if conn.closed:
                pool.release(conn)
                conn = await pool.acquire()
            try:
                status = await conn.send(target.request)
            except (OSError, httptools.HttpParserError):
                errors += 1
                continue
            if status != 200:
                errors += 1
            elif begin <= time.perf_counter() <= end:
                done += 1
        pool.release(conn)

    tasks = [asyncio.ensure_future(client()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=seconds + warmup_s + DRAIN_S)
    for t in pending:
        t.cancel()
    pool.close()
    return done / seconds, errors + len(pending)
