"""A fault-injecting TCP proxy: latency, bandwidth caps, resets, blackholes and slow closes.

Kernel latency injection (`tc netem`) is unavailable on our machines, so drills put this
user-space proxy between a client and a node, region, Redis or Postgres and change its
faults while connections are open. A fault applies to data read from the moment it is
set; bytes already queued keep the treatment they were given when they were read.

Directions: "upstream" is client → upstream server, "downstream" is upstream → client.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Literal

Direction = Literal["upstream", "downstream"]
DIRECTIONS: tuple[Direction, Direction] = ("upstream", "downstream")

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 64
CONNECT_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 1.0
STOP_TIMEOUT_S = 2.0


class ProxyError(ValueError):
    """A fault was asked for with invalid parameters, or the proxy was misused."""


@dataclass
class DirectionStats:
    """Bytes seen in one direction: read from the source, written on, dropped by a fault."""

    received: int = 0
    forwarded: int = 0
    dropped: int = 0


@dataclass
class ProxyStats:
    """Counters for drill reports; `snapshot()` returns a copy safe to keep."""

    accepted: int = 0
    active: int = 0
    closed: int = 0
    reset: int = 0
    blackholed: int = 0
    upstream_failures: int = 0
    upstream: DirectionStats = field(default_factory=DirectionStats)
    downstream: DirectionStats = field(default_factory=DirectionStats)

    def snapshot(self) -> ProxyStats:
        """A deep copy, so a report is not changed by traffic that follows."""
        return replace(self, upstream=replace(self.upstream), downstream=replace(self.downstream))


@dataclass
class _DirectionFaults:
    """Faults that apply to one direction of every connection."""

    latency_s: float = 0.0
    jitter_s: float = 0.0
    bytes_per_s: float | None = None
    close_delay_s: float = 0.0


class _TokenBucket:
    """Rate limiter shared by every connection in one direction, like a capped link.

    Tokens may go negative: a writer reserves its bytes at once and sleeps off the debt, so
    concurrent writers queue up fairly without polling.
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        # A small burst (50 ms worth) keeps the pacing smooth at the rate's time scale.
        self.burst = max(1024.0, bytes_per_s / 20)
        self._tokens = self.burst
        self._last = time.monotonic()

    def reserve(self, n: int) -> float:
        """Take `n` bytes' worth of tokens; return how long the caller must wait."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        return max(0.0, -self._tokens / self.rate)


class _Connection:
    """One client connection and, unless it was blackholed on accept, its upstream."""

    def __init__(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.client_reader = client_reader
        self.client_writer = client_writer
        self.upstream_reader: asyncio.StreamReader | None = None
        self.upstream_writer: asyncio.StreamWriter | None = None
        # A blackholed connection stays dead after heal: its peers already lost data, and
        # resuming mid-stream would hand them a corrupted byte stream.
        self.dead = False
        self.task: asyncio.Task[None] | None = None

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client_writer, self.upstream_writer) if w is not None]

    def abort(self, rst: bool) -> None:
        """Drop both sides now; with `rst`, send TCP RST (SO_LINGER 0) instead of FIN."""
        for writer in self.writers():
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()


class FaultProxy:
    """Asyncio TCP proxy whose faults can be changed while connections are open.

    Parameter names match the drill fault params in `chaos.drill.FAULT_PARAMS`.
    """

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        upstream_host: str,
        upstream_port: int,
        *,
        seed: int | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.connect_timeout_s = connect_timeout_s
        self.stats = ProxyStats()
        # Seeded so a drill's jitter and reset choices can be replayed.
        self._rng = random.Random(seed)
        self._faults: dict[Direction, _DirectionFaults] = {d: _DirectionFaults() for d in DIRECTIONS}
        self._buckets: dict[Direction, _TokenBucket | None] = {d: None for d in DIRECTIONS}
        self._reset_probability = 0.0
        self._blackhole = False
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()
        self._port: int | None = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the proxy listens on (the real one when started with port 0)."""
        if self._port is None:
            raise ProxyError("the proxy has not been started")
        return self._port

    async def start(self) -> None:
        """Start listening; returns once the port is bound."""
        if self._server is not None:
            raise ProxyError("the proxy is already started")
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and close every connection now, dropping data still queued."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        conns = list(self._conns)
        for conn in conns:
            conn.abort(rst=False)
        tasks = [c.task for c in conns if c.task is not None]
        if tasks:
            # Handlers were cancelled above; bound the wait in case one is stuck in cleanup.
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), STOP_TIMEOUT_S)

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- faults ----------------------------------------------------------------------

    def _directions(self, direction: Direction | None) -> tuple[Direction, ...]:
        if direction is None:
            return DIRECTIONS
        if direction not in DIRECTIONS:
            raise ProxyError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        return (direction,)

    def set_latency(
        self, latency_ms: float, jitter_ms: float = 0.0, direction: Direction | None = None
    ) -> None:
        """Delay each chunk by `latency_ms` ± `jitter_ms` (uniform), keeping byte order."""
        if latency_ms < 0 or jitter_ms < 0:
            raise ProxyError(f"latency_ms and jitter_ms must be >= 0, got {latency_ms}, {jitter_ms}")
        for d in self._directions(direction):
            self._faults[d].latency_s = latency_ms / 1000
            self._faults[d].jitter_s = jitter_ms / 1000

    def set_bandwidth(self, bytes_per_s: float | None, direction: Direction | None = None) -> None:
        """Cap throughput to `bytes_per_s` per direction, shared by all connections; None lifts it."""
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ProxyError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        for d in self._directions(direction):
            self._faults[d].bytes_per_s = bytes_per_s
            self._buckets[d] = None if bytes_per_s is None else _TokenBucket(bytes_per_s)

    def reset(self, probability: float = 1.0) -> None:
        """Reset (RST) each open connection with `probability`, and new ones on accept while on."""
        if not 0 < probability <= 1:
            raise ProxyError(f"probability must be in (0, 1], got {probability}")
        self._reset_probability = probability
        for conn in list(self._conns):
            if self._rng.random() < probability:
                self.stats.reset += 1
                conn.abort(rst=True)

    def blackhole(self) -> None:
        """Read and drop everything, answer nothing: open and new connections hang."""
        self._blackhole = True
        for conn in self._conns:
            if not conn.dead:
                conn.dead = True
                self.stats.blackholed += 1

    def slow_close(self, delay_ms: float, direction: Direction | None = None) -> None:
        """When a side closes (FIN), wait `delay_ms` before passing the close on."""
        if delay_ms < 0:
            raise ProxyError(f"delay_ms must be >= 0, got {delay_ms}")
        for d in self._directions(direction):
            self._faults[d].close_delay_s = delay_ms / 1000

    def heal(self) -> None:
        """Back to a transparent proxy; connections blackholed earlier stay dead."""
        for d in DIRECTIONS:
            self._faults[d] = _DirectionFaults()
            self._buckets[d] = None
        self._reset_probability = 0.0
        self._blackhole = False

    def apply(self, kind: str, params: Mapping[str, float]) -> None:
        """Apply a drill fault (`proxy_*` kind with its params from the drill file)."""
        p = dict(params)
        try:
            if kind == "proxy_latency":
                self.set_latency(p.pop("latency_ms"), p.pop("jitter_ms", 0.0))
            elif kind == "proxy_bandwidth":
                self.set_bandwidth(p.pop("bytes_per_s"))
            elif kind == "proxy_reset":
                self.reset(p.pop("probability", 1.0))
            elif kind == "proxy_blackhole":
                self.blackhole()
            elif kind == "proxy_slow_close":
                self.slow_close(p.pop("delay_ms", 1000.0))
            else:
                raise ProxyError(f"{kind!r} is not a proxy fault")
        except KeyError as e:
            raise ProxyError(f"{kind} needs parameter {e.args[0]!r}") from None
        if p:
            raise ProxyError(f"{kind} does not take parameters {sorted(p)}")

    # -- data path -------------------------------------------------------------------

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        conn = _Connection(client_reader, client_writer)
        conn.task = asyncio.current_task()
        self.stats.accepted += 1
        if self._reset_probability and self._rng.random() < self._reset_probability:
            self.stats.reset += 1
            self.stats.closed += 1
            conn.abort(rst=True)
            return
        self._conns.add(conn)
        self.stats.active += 1
        try:
            if self._blackhole:
                conn.dead = True
                self.stats.blackholed += 1
                await self._drain_dead(conn)
                return
            try:
                conn.upstream_reader, conn.upstream_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.upstream_host, self.upstream_port), self.connect_timeout_s
                )
            except (OSError, TimeoutError):
                # The client sees its connection closed, as it would behind a real L4 balancer.
                self.stats.upstream_failures += 1
                return
            await self._relay(conn)
        except (asyncio.CancelledError, ConnectionError, OSError):
            pass
        finally:
            self._conns.discard(conn)
            self.stats.active -= 1
            self.stats.closed += 1
            await self._close(conn)

    async def _drain_dead(self, conn: _Connection) -> None:
        """Swallow a blackholed-on-accept client's bytes until it leaves or the proxy stops."""
        while data := await conn.client_reader.read(CHUNK_BYTES):
            self.stats.upstream.received += len(data)
            self.stats.upstream.dropped += len(data)

    async def _relay(self, conn: _Connection) -> None:
        """Run a reader and a writer per direction until both directions end or one breaks."""
        assert conn.upstream_reader is not None and conn.upstream_writer is not None
        # Bounded so a slowed direction pushes back on its sender through TCP instead of
        # buffering without limit in the proxy.
        up_q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        down_q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        client_read = asyncio.create_task(self._read_side(conn, "upstream", conn.client_reader, up_q))
        tasks = {
            client_read,
            asyncio.create_task(self._write_side(conn, "upstream", up_q, conn.upstream_writer)),
            asyncio.create_task(self._read_side(conn, "downstream", conn.upstream_reader, down_q)),
            asyncio.create_task(self._write_side(conn, "downstream", down_q, conn.client_writer)),
        }
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    # One side was reset or broke: pass the failure on to the other side.
                    conn.abort(rst=True)
                    return
                # A dead connection ends when its client leaves; the upstream is never told.
                if conn.dead and client_read in done:
                    return
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read_side(
        self,
        conn: _Connection,
        direction: Direction,
        src: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes]],
    ) -> None:
        """Read one direction and stamp each chunk with its release time; b"" marks EOF."""
        stats = self.stats.upstream if direction == "upstream" else self.stats.downstream
        last_release = 0.0
        while True:
            data = await src.read(CHUNK_BYTES)
            if data:
                stats.received += len(data)
                if conn.dead:
                    stats.dropped += len(data)
                    continue
            faults = self._faults[direction]
            delay = faults.latency_s
            if faults.jitter_s:
                delay = max(0.0, delay + self._rng.uniform(-faults.jitter_s, faults.jitter_s))
            # Never release before the previous chunk, so jitter cannot reorder the stream.
            last_release = max(time.monotonic() + delay, last_release)
            await queue.put((last_release, data))
            if not data:
                return

    async def _write_side(
        self,
        conn: _Connection,
        direction: Direction,
        queue: asyncio.Queue[tuple[float, bytes]],
        dst: asyncio.StreamWriter,
    ) -> None:
        """Write one direction's chunks at their release time, paced by the bandwidth cap."""
        stats = self.stats.upstream if direction == "upstream" else self.stats.downstream
        while True:
            release, data = await queue.get()
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if conn.dead:
                    # A partitioned peer never learns that the other side closed.
                    return
                close_delay = self._faults[direction].close_delay_s
                if close_delay:
                    await asyncio.sleep(close_delay)
                if dst.can_write_eof() and not dst.is_closing():
                    dst.write_eof()
                return
            if conn.dead:
                stats.dropped += len(data)
                continue
            await self._write_paced(direction, dst, data)
            stats.forwarded += len(data)

    async def _write_paced(self, direction: Direction, dst: asyncio.StreamWriter, data: bytes) -> None:
        bucket = self._buckets[direction]
        if bucket is None:
            dst.write(data)
            await dst.drain()
            return
        step = int(bucket.burst)
        for i in range(0, len(data), step):
            piece = data[i : i + step]
            # Re-read the bucket per piece so heal or a new rate takes effect mid-chunk.
            bucket = self._buckets[direction]
            if bucket is not None:
                wait = bucket.reserve(len(piece))
                if wait > 0:
                    await asyncio.sleep(wait)
            dst.write(piece)
            await dst.drain()

    async def _close(self, conn: _Connection) -> None:
        for writer in conn.writers():
            if writer.is_closing():
                continue
            writer.close()
            with contextlib.suppress(OSError, TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT_S)


@asynccontextmanager
async def running_proxy(
    upstream_host: str,
    upstream_port: int,
    listen_host: str = "127.0.0.1",
    listen_port: int = 0,
    *,
    seed: int | None = None,
) -> AsyncIterator[FaultProxy]:
    """A started proxy in front of `upstream_host:upstream_port`, stopped on exit."""
    proxy = FaultProxy(listen_host, listen_port, upstream_host, upstream_port, seed=seed)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
