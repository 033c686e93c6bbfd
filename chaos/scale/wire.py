"""A small keep-alive HTTP/1.1 client for the simulated nodes: one pool of connections per
process, shared by thousands of agents.

Why not httpx: a simulated fleet sends thousands of heartbeats a second from two cores
shared with the control plane it measures, and httpx spends about a millisecond of CPU on
each request; this client spends a small fraction of that, so the figures are the control
plane's and not the simulator's. It speaks plain HTTP/1.1 (Content-Length or chunked
answers, keep-alive, no pipelining); a connection the server closed is replaced and the
request sent once more on a fresh one, as any HTTP client does for an idempotent retry.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass


class WireError(Exception):
    """The server could not be reached or answered something that is not HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class WirePool:
    """At most `size` keep-alive connections to one host:port, each carrying one request at a time."""

    def __init__(self, host: str, port: int, token: str, size: int, timeout_s: float = 10.0) -> None:
        self._host, self._port = host, port
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._timeout_s = timeout_s
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(size)

    async def request(self, method: str, path: str, body: bytes = b"", timeout_s: float | None = None) -> Answer:
        """One request; `timeout_s` (default: the pool's) bounds the exchange, not the wait for a slot."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        async with self._slots:
            head = (f"{method} {path} HTTP/1.1\r\nHost: {self._host}:{self._port}\r\n{self._auth}"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect()
            try:
                result = await asyncio.wait_for(self._exchange(conn, head + body), timeout)
            except (OSError, asyncio.IncompleteReadError, WireError) as exc:
                conn.close()
                if not reused:
                    raise WireError(str(exc) or type(exc).__name__) from exc
                # The server closed an idle keep-alive connection: once more on a fresh one.
                conn = await self._connect()
                try:
                    result = await asyncio.wait_for(self._exchange(conn, head + body), timeout)
                except (OSError, asyncio.IncompleteReadError, WireError) as exc2:
                    conn.close()
                    raise WireError(str(exc2) or type(exc2).__name__) from exc2
            except BaseException:  # a timeout, or the agent cancelled (a killed node)
                conn.close()
                raise
            answer, keep = result
            if keep:
                self._idle.append(conn)
            else:
                conn.close()
            return answer

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port), self._timeout_s)
        except OSError as exc:
            raise WireError(f"connect {self._host}:{self._port}: {exc}") from exc
        return _Conn(reader, writer)

    async def _exchange(self, conn: _Conn, data: bytes) -> tuple[Answer, bool]:
        """Send one request and read its answer: (answer, whether the connection may be reused)."""
        conn.writer.write(data)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")
        status, headers = _parse_head(head)
        if "content-length" in headers:
            body = await conn.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await _read_chunked(conn.reader)
        else:
            body = b""
        return Answer(status, body), headers.get("connection", "").lower() != "close"


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise WireError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
