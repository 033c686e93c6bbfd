"""What a stream's per-chunk read timeout costs the router, per chunk.

    python -m bench.stream_reads [--chunks 50000] [--rounds 3]

A real node sends a stream's tokens as they are made, about one chunk each, and the router
reads every chunk with a timeout (the read timeout, or the inter-token timeout of a
migratable stream). The baseline wraps each read in `asyncio.timeout_at`, as the router did:
a timer made and cancelled per chunk. Ours is `UpstreamConnection.read_chunk_by`: one timer
per connection, moved only when it would fire late. Both read `--chunks` one-event chunks,
each handed to the connection on the next loop turn as a node's would be, on uvloop as the
router runs; rounds alternate, medians. A third path reads without any timeout: what the
timeout itself adds is each path's time less that one.

Figures (bench `stream_reads`): `timeout_us_per_chunk` (ours: read_chunk_by's added time;
baseline: asyncio.timeout_at's).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import uvloop

from bench.common import Figure, median
from geo_router.forwarding.upstream import Origin, UpstreamConnection

BENCH = "stream_reads"
_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":" the"}}]}\n\n'
_CHUNK = f"{len(_EVENT):x}\r\n".encode() + _EVENT + b"\r\n"


class _Transport:
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def write(self, data: bytes) -> None: ...
    def close(self) -> None: ...


def _streaming() -> UpstreamConnection:
    conn = UpstreamConnection(Origin.parse("http://node.invalid"))
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.send(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n", b"")
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    return conn


async def _per_chunk_us(way: str, chunks: int) -> float:
    loop = asyncio.get_running_loop()
    conn = _streaming()
    started = time.perf_counter()
    for _ in range(chunks):
        loop.call_soon(conn.data_received, _CHUNK)
        if way == "timeout_at":
            async with asyncio.timeout_at(loop.time() + 30):
                await conn.read_chunk()
        elif way == "read_chunk_by":
            await conn.read_chunk_by(loop.time() + 30)
        else:
            await conn.read_chunk()
    return (time.perf_counter() - started) / chunks * 1e6


def run(chunks: int = 50_000, rounds: int = 3) -> list[Figure]:
    times: dict[str, list[float]] = {"none": [], "timeout_at": [], "read_chunk_by": []}
    for r in range(rounds):
        ways = list(times) if r % 2 == 0 else list(reversed(times))
        for way in ways:
            times[way].append(uvloop.run(_per_chunk_us(way, chunks)))
    bare = median(times["none"])
    ours, baseline = median(times["read_chunk_by"]) - bare, median(times["timeout_at"]) - bare
    print(f"# per chunk: {bare:.2f} µs read alone, +{baseline:.2f} µs with asyncio.timeout_at, "
          f"+{ours:.2f} µs with read_chunk_by", file=sys.stderr)
    return [Figure(BENCH, "timeout_us_per_chunk", ours, baseline,
                   "asyncio.timeout_at around each read (a timer per chunk), same run", "reported", "us")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for fig in run(args.chunks, args.rounds):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
