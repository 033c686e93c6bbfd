"""The fault proxy over real loopback sockets: each fault does what a drill relies on, and heal undoes it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from chaos.drill import FAULT_PARAMS
from chaos.faults import FaultProxy, ProxyError, running_proxy
from meridian.ports import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
IO_TIMEOUT_S = 5.0


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read to EOF, then answer with the byte count: a one-way bulk transfer."""
    total = 0
    while data := await reader.read(65536):
        total += len(data)
    writer.write(str(total).encode())
    await writer.drain()
    writer.close()


async def _closer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Say bye and close at once, so the only thing to wait for is the close itself."""
    writer.write(b"bye")
    await writer.drain()
    writer.close()


@asynccontextmanager
async def _serve(handler: Handler) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async with _serve(_echo) as port:
        yield port


@pytest.fixture
async def proxy(echo_port: int) -> AsyncIterator[FaultProxy]:
    async with running_proxy("127.0.0.1", echo_port, seed=7) as p:
        yield p


async def _connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy.port), IO_TIMEOUT_S)


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> float:
    start = time.monotonic()
    writer.write(payload)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(payload)), IO_TIMEOUT_S)
    assert got == payload
    return time.monotonic() - start


async def _eventually(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_transparent_proxy_echoes_and_counts_bytes_per_direction(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    payload = bytes(range(256)) * 400  # 100 KiB, several chunks
    await _round_trip(reader, writer, payload)
    writer.close()
    await _eventually(lambda: proxy.stats.active == 0)
    stats = proxy.stats.snapshot()
    assert stats.accepted == 1 and stats.closed == 1
    assert stats.upstream.forwarded == stats.downstream.forwarded == len(payload)
    assert stats.upstream.dropped == stats.downstream.dropped == 0


async def test_latency_applies_to_an_open_connection_and_heal_removes_it(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    assert await _round_trip(reader, writer, b"ping") < 0.1
    proxy.set_latency(100)
    slow = [await _round_trip(reader, writer, b"ping") for _ in range(3)]
    # Each direction adds 100 ms, so a round trip costs at least 200 ms.
    assert all(0.2 <= t < 0.4 for t in slow), slow
    proxy.heal()
    assert await _round_trip(reader, writer, b"ping") < 0.1
    writer.close()


async def test_latency_in_one_direction_only(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    proxy.set_latency(150, direction="downstream")
    rtt = await _round_trip(reader, writer, b"ping")
    assert 0.15 <= rtt < 0.28
    writer.close()


async def test_jitter_stays_within_bounds_and_keeps_byte_order(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    proxy.set_latency(50, jitter_ms=30)
    rtts = [await _round_trip(reader, writer, b"x") for _ in range(10)]
    # One-way delay is 50 ± 30 ms, so a round trip lies in [40, 160] ms plus scheduling slack.
    assert all(0.04 <= t < 0.2 for t in rtts), rtts
    assert max(rtts) - min(rtts) > 0.005, "jitter had no effect"
    # Many small writes in flight at once: jitter must never reorder the stream.
    messages = [f"{i:04d};".encode() for i in range(50)]
    for m in messages:
        writer.write(m)
        await asyncio.sleep(0.002)
    await writer.drain()
    expected = b"".join(messages)
    assert await asyncio.wait_for(reader.readexactly(len(expected)), IO_TIMEOUT_S) == expected
    writer.close()


async def test_bandwidth_cap_paces_a_bulk_transfer() -> None:
    async with _serve(_sink) as sink_port:
        async with running_proxy("127.0.0.1", sink_port) as proxy:
            proxy.set_bandwidth(200_000)
            reader, writer = await _connect(proxy)
            payload = b"b" * 200_000
            start = time.monotonic()
            writer.write(payload)
            writer.write_eof()
            reply = await asyncio.wait_for(reader.read(), IO_TIMEOUT_S)
            elapsed = time.monotonic() - start
            assert reply == b"200000"
            # 200 KB at 200 KB/s is about one second; uncapped it takes milliseconds.
            assert 0.8 <= elapsed < 2.0, elapsed
            writer.close()


async def _assert_reset(reader: asyncio.StreamReader) -> None:
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), IO_TIMEOUT_S)


async def test_reset_kills_open_and_new_connections_until_heal(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    await _round_trip(reader, writer, b"hello")
    proxy.reset()
    await _assert_reset(reader)
    new_reader, _ = await _connect(proxy)
    await _assert_reset(new_reader)
    assert proxy.stats.reset == 2
    proxy.heal()
    healed_reader, healed_writer = await _connect(proxy)
    await _round_trip(healed_reader, healed_writer, b"back")
    healed_writer.close()


async def test_blackhole_hangs_requests_and_heal_serves_new_connections(proxy: FaultProxy) -> None:
    old_reader, old_writer = await _connect(proxy)
    await _round_trip(old_reader, old_writer, b"before")
    proxy.blackhole()
    with pytest.raises(TimeoutError):
        await _round_trip_within(old_reader, old_writer, b"lost", 0.3)
    new_reader, new_writer = await _connect(proxy)  # the accept still succeeds: it is a hang, not a refusal
    with pytest.raises(TimeoutError):
        await _round_trip_within(new_reader, new_writer, b"lost too", 0.3)
    proxy.heal()
    healed_reader, healed_writer = await _connect(proxy)
    await _round_trip(healed_reader, healed_writer, b"after")
    # Connections that were blackholed stay dead: their byte streams already lost data.
    with pytest.raises(TimeoutError):
        await _round_trip_within(old_reader, old_writer, b"still lost", 0.3)
    assert proxy.stats.blackholed == 2
    assert proxy.stats.upstream.dropped == len(b"lost") + len(b"lost too") + len(b"still lost")
    for w in (old_writer, new_writer, healed_writer):
        w.close()


async def _round_trip_within(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes, timeout_s: float
) -> None:
    writer.write(payload)
    await writer.drain()
    await asyncio.wait_for(reader.readexactly(len(payload)), timeout_s)


async def test_slow_close_delays_the_eof_by_the_configured_time() -> None:
    async with _serve(_closer) as closer_port:
        async with running_proxy("127.0.0.1", closer_port) as proxy:
            proxy.slow_close(delay_ms=400)
            reader, writer = await _connect(proxy)
            assert await asyncio.wait_for(reader.readexactly(3), IO_TIMEOUT_S) == b"bye"
            start = time.monotonic()
            assert await asyncio.wait_for(reader.read(), IO_TIMEOUT_S) == b""
            assert 0.38 <= time.monotonic() - start < 0.8
            writer.close()
            proxy.heal()
            reader, writer = await _connect(proxy)
            await asyncio.wait_for(reader.readexactly(3), IO_TIMEOUT_S)
            start = time.monotonic()
            assert await asyncio.wait_for(reader.read(), IO_TIMEOUT_S) == b""
            assert time.monotonic() - start < 0.2
            writer.close()


async def test_stop_closes_every_connection_promptly(echo_port: int) -> None:
    proxy = FaultProxy("127.0.0.1", 0, "127.0.0.1", echo_port)
    await proxy.start()
    live = await _connect(proxy)
    await _round_trip(*live, b"hi")
    proxy.set_latency(5000)  # data queued for 5 s must not hold stop up
    live[1].write(b"queued")
    proxy.blackhole()
    hung = await _connect(proxy)
    await _eventually(lambda: proxy.stats.active == 2)
    start = time.monotonic()
    await proxy.stop()
    assert time.monotonic() - start < 0.5
    for reader, writer in (live, hung):
        try:
            assert await asyncio.wait_for(reader.read(), 1.0) == b""
        except ConnectionResetError:
            pass
        writer.close()
    assert proxy.stats.active == 0
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", proxy.port)


async def test_unreachable_upstream_closes_the_client_and_is_counted() -> None:
    async with running_proxy("127.0.0.1", free_port()) as proxy:
        reader, writer = await _connect(proxy)
        assert await asyncio.wait_for(reader.read(), IO_TIMEOUT_S) == b""
        assert proxy.stats.upstream_failures == 1
        writer.close()


def test_every_proxy_fault_of_the_drill_schema_can_be_applied() -> None:
    proxy = FaultProxy("127.0.0.1", 0, "127.0.0.1", 1)
    values = {"latency_ms": 10, "jitter_ms": 2, "bytes_per_s": 1000, "probability": 0.5, "delay_ms": 100}
    kinds = [k for k in FAULT_PARAMS if k.startswith("proxy_")]
    assert len(kinds) == 5
    for kind in kinds:
        required, optional = FAULT_PARAMS[kind]
        proxy.apply(kind, {name: values[name] for name in required | optional})
        proxy.apply(kind, {name: values[name] for name in required})
        proxy.heal()
    with pytest.raises(ProxyError, match="latency_ms"):
        proxy.apply("proxy_latency", {})
    with pytest.raises(ProxyError, match="lattency_ms"):
        proxy.apply("proxy_latency", {"latency_ms": 1, "lattency_ms": 1})
    with pytest.raises(ProxyError, match="not a proxy fault"):
        proxy.apply("process_crash", {})
    with pytest.raises(ProxyError):
        proxy.set_bandwidth(0)
