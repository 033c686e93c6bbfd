"""A raw HTTP/2 client for tests of a listener's HTTP/2 limits (meridian.http2): the h2
library's client state machine over one asyncio connection (h2c by prior knowledge), and
frames as bytes for what a well-behaved client would never send (floods)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator

import h2.config
import h2.connection
import h2.events
import h2.settings


class H2Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 conn: h2.connection.H2Connection) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = conn
        self.events: list[h2.events.Event] = []
        self.eof = False
        # Frames sent, by type.
        self.sent: Counter[int] = Counter()

    @classmethod
    async def open(cls, port: int, window: int | None = None) -> H2Client:
        """A connection to 127.0.0.1:`port` that has sent its preface (and SETTINGS, with
        `window` as its initial stream window when given)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        if window is not None:
            conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        client = cls(reader, writer, conn)
        await client.flush()
        return client

    def request(self, stream_id: int, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes = b"", end: bool = True) -> None:
        """Open `stream_id` with a request; its body ends (END_STREAM) when `end`."""
        head = [(":method", method), (":path", path), (":scheme", "http"), (":authority", "router"),
                *(headers or {}).items()]
        self.conn.send_headers(stream_id, head, end_stream=end and not body)
        if body:
            self.conn.send_data(stream_id, body, end_stream=end)

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        self.sent.update(kind for kind, _, _, _ in frames_of(data))
        self.writer.write(data)
        await self.writer.drain()

    async def until(self, done: Callable[[h2.events.Event], bool], within_s: float) -> h2.events.Event:
        """Read until an event for which `done` holds (kept in `events` with the others),
        acknowledging data as it comes; TimeoutError when none within `within_s`."""
        async with asyncio.timeout(within_s):
            while True:
                for event in self.events:
                    if done(event):
                        return event
                data = await self.reader.read(65536)
                if not data:
                    self.eof = True
                    raise ConnectionError("the server closed the connection")
                for event in self.conn.receive_data(data):
                    self.events.append(event)
                    if isinstance(event, h2.events.DataReceived):
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                await self.flush()

    def body(self, stream_id: int) -> bytes:
        return b"".join(e.data for e in self.events
                        if isinstance(e, h2.events.DataReceived) and e.stream_id == stream_id)

    def status(self, stream_id: int) -> int | None:
        for e in self.events:
            if isinstance(e, h2.events.ResponseReceived) and e.stream_id == stream_id:
                return int(dict(e.headers)[":status"])
        return None

    def close(self) -> None:
        self.writer.close()


def frame(kind: int, payload: bytes = b"", flags: int = 0, stream_id: int = 0) -> bytes:
    """One HTTP/2 frame as bytes."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def frames_of(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each whole frame in what a server sent."""
    pos = 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        if pos + 9 + length > len(data):
            return
        yield data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF, \
            data[pos + 9:pos + 9 + length]
        pos += 9 + length


class LoopLag:
    """How long this process's event loop went without running its tasks, summed over the
    stalls longer than STALL_S: time a starved test process lost is not the server's."""

    TICK_S = 0.01
    STALL_S = 0.05

    def __init__(self) -> None:
        self.lost = 0.0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic()
            late = now - last - self.TICK_S
            if late > self.STALL_S:
                self.lost += late
            last = now

    def stop(self) -> float:
        self._task.cancel()
        return self.lost


async def flood(port: int, frames: bytes, seconds: float, after_settings: bool = False) -> tuple[bytes, float | None]:
    """Open an h2c connection and send `frames` over and over for `seconds` (or until the
    server closes it), from the preface on or `after_settings` came from the server: what
    the server sent, and how long it took to close once flooded (None: it did not), less the
    time this process was stalled meanwhile (a CI run's: 3.2 s for a close seen at once
    after the stall, the GOAWAY having come before it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    preface = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    preface.initiate_connection()
    writer.write(preface.data_to_send())
    received = bytearray()
    if after_settings:
        async with asyncio.timeout(5):
            received += await reader.read(65536)
    started = time.monotonic()
    lag = LoopLag()

    async def read_all() -> float:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                received.extend(data)
        return time.monotonic() - started

    closed = asyncio.ensure_future(read_all())
    burst = frames * max(1, 16384 // len(frames))
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(seconds + 1):  # drain waits while the server does not read
            while not closed.done() and time.monotonic() - started < seconds:
                writer.write(burst)
                await writer.drain()
                await asyncio.sleep(0)  # drain does not yield while the buffer is low: let the reader run
    try:
        elapsed: float | None = await asyncio.wait_for(closed, 3)
    except TimeoutError:
        elapsed = None
    stalled = lag.stop()
    writer.close()
    return bytes(received), None if elapsed is None else max(0.0, elapsed - stalled)
