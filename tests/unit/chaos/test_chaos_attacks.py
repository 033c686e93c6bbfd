"""The attack suite's own judgement (chaos.attacks): a flood is seen as cut off when the server
closes the connection, stops reading it for good or answers GOAWAY, and not when it takes
everything; `check` names every bound a result breaks and nothing when it holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from chaos.attacks import Bounds, Outcome, check, wire
from chaos.attacks.http2 import EMPTY_SETTINGS, _frames, _watch_for_goaway
from chaos.attacks.neighbour import Sample, window
from chaos.attacks.result import AttackResult

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]
CHUNK = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n" * 1000


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Coroutine[Any, Any, int]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> int:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    yield start
    for s in servers:
        s.close()


async def _reads_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(1 << 20):
        pass
    writer.close()


async def _reads_some_then_stops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # The listener's bound: a few requests parsed and waiting, then no more reading.
    await reader.readexactly(len(CHUNK))
    writer.transport.pause_reading()
    await asyncio.sleep(30)


async def _closes_after_some(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readexactly(len(CHUNK))
    writer.transport.abort()


async def test_a_server_that_takes_everything_has_not_cut_the_flood_off(serve: Any) -> None:
    _, writer = await wire.connect("127.0.0.1", await serve(_reads_all))
    poured = await wire.pour(writer, CHUNK, 50 * len(CHUNK), time.monotonic() + 5)
    await wire.close(writer)
    assert poured.accepted == 50 * len(CHUNK)
    assert poured.broken_at is None and poured.stalled_since(0.2) is None


async def test_a_server_that_stops_reading_has_cut_the_flood_off_where_it_stopped(serve: Any) -> None:
    _, writer = await wire.connect("127.0.0.1", await serve(_reads_some_then_stops))
    start = time.monotonic()
    poured = await wire.pour(writer, CHUNK, 10**9, start + 2.0)
    await wire.close(writer)
    stalled = poured.stalled_since(0.5)
    assert stalled is not None and stalled - start < 1.5, poured
    assert poured.accepted < 10**9 and poured.broken_at is None


async def test_a_server_that_closes_breaks_the_flood(serve: Any) -> None:
    _, writer = await wire.connect("127.0.0.1", await serve(_closes_after_some))
    start = time.monotonic()
    poured = await wire.pour(writer, CHUNK, 10**9, start + 5.0)
    await wire.close(writer)
    assert poured.broken_at is not None and poured.broken_at - start < 2.0, poured


async def test_goaway_is_read_with_its_error_code(serve: Any) -> None:
    async def calm_down(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(len(EMPTY_SETTINGS) * 100)
        # SETTINGS ACK, then GOAWAY (last stream 0, ENHANCE_YOUR_CALM), split across writes.
        goaway = b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x0b"
        writer.write(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00" + goaway[:5])
        await writer.drain()
        writer.write(goaway[5:])
        await asyncio.sleep(30)

    reader, writer = await wire.connect("127.0.0.1", await serve(calm_down))
    ended, verdict = asyncio.Event(), []
    watcher = asyncio.create_task(_watch_for_goaway(reader, ended, verdict))
    poured = await wire.pour(writer, EMPTY_SETTINGS * 100, 10**9, time.monotonic() + 5, stop=ended)
    await asyncio.wait_for(watcher, 5)
    await wire.close(writer)
    assert [how for how, _ in verdict] == ["GOAWAY ENHANCE_YOUR_CALM"]
    assert poured.accepted < 10**9


def test_frames_are_taken_whole_and_a_partial_one_waits() -> None:
    buffer = bytearray(EMPTY_SETTINGS * 2 + b"\x00\x00\x04\x03")
    assert _frames(buffer) == [(4, b""), (4, b"")]
    assert buffer == b"\x00\x00\x04\x03"


def test_the_neighbours_window_counts_only_requests_due_in_it() -> None:
    samples = [Sample(t / 100, ms, ok) for t, ms, ok in
               [(0, 1.0, True), (100, 2.0, True), (101, 900.0, False), (150, 3.0, True), (300, 5.0, True)]]
    w = window(samples, 1.0, 2.0)
    assert (w.requests, w.failed, w.p50_ms, w.p99_ms) == (3, 1, 3.0, 900.0)


def _result(outcome: Outcome, *, p99: float = 5.0, failed: int = 0, peak: float = 120.0,
            after: float = 110.0) -> AttackResult:
    return AttackResult("pipelining", "router", "short", outcome, Bounds(cut_off_s=2.0), 1.0, 2.0, 1.5, p99,
                        300, failed, 100.0, peak, after)


def test_check_passes_a_result_within_every_bound() -> None:
    assert check(_result(Outcome(1000, 0.4, "stalled (stopped reading)", 3.0))) == []


def test_check_names_every_bound_broken() -> None:
    failures = check(_result(Outcome(6_600_000, None, "the server took all 200,000 requests", 3.0),
                             p99=2900.0, failed=3, peak=407.0, after=414.0))
    assert [f.split(": ", 1)[1].split(" ", 2)[:2] for f in failures] == [
        ["never", "cut"], ["3", "of"], ["neighbour", "p99"], ["RSS", "peak"], ["RSS", "414"]]


def test_check_holds_a_late_cut_off_and_a_wrong_close_code_against_the_attack() -> None:
    late = check(_result(Outcome(1000, 2.5, "closed", 3.0)))
    assert len(late) == 1 and "cut off after 2.50 s" in late[0]
    wrong = check(_result(Outcome(1000, 0.5, "close 1001", 0.5, wrong_kind="closed with close 1001, not 1008")))
    assert wrong == ["pipelining (router): closed with close 1001, not 1008"]
