"""Writing a flood and telling when the server stopped taking it.

Contract: `pour(writer, chunk, max_bytes, deadline, stop)` writes `chunk` again and again
until `max_bytes` are written, `deadline` (monotonic) passes, `stop` is set or the
connection breaks, and says how many bytes the kernel took (`accepted`), when it last took
any, and whether the peer broke the connection. `Poured.stalled_since(stall_s)` is the
moment the server stopped reading, when it never read again from then to the end and that
lasted at least `stall_s`: a listener that stops reading a connection (as nginx does when
pipelined requests queue up) has cut the flood off as surely as one that closes it.

Why bytes the server read, and not bytes written or bytes the kernel took: a write into
a user-space buffer costs the server nothing, and neither do bytes in the kernel's socket
queues, which on loopback autotune to megabytes (tcp_rmem's maximum is 32 MiB here). A
server that stopped reading seemed, by the kernel's count, to read on for seconds while its
receive queue filled. So the server's progress is what the kernel took less what is still
queued unread on this connection, from /proc/net/tcp: the client's send queue and the
server's receive queue (`unread_bytes`); `accepted` stays what the kernel took (the bytes
sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from chaos.attacks.result import Outcome

# How often a blocked write looks at its buffer to see whether the server took some.
POLL_S = 0.05


def unread_bytes(sock: socket.socket) -> int:
    """Bytes of this loopback TCP connection that the server has not read yet: the send
    queue of `sock` (the client's) and the receive queue of its peer's socket (IPv4)."""
    local, peer = _proc_addr(sock.getsockname()), _proc_addr(sock.getpeername())
    unread = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        tx, rx = (int(q, 16) for q in fields[4].split(":"))
        if (fields[1], fields[2]) == (local, peer):
            unread += tx
        elif (fields[1], fields[2]) == (peer, local):
            unread += rx
    return unread


def _proc_addr(addr: tuple[str, int]) -> str:
    """An IPv4 address as /proc/net/tcp writes it: the address's bytes little-endian, in hex."""
    return f"{int.from_bytes(socket.inet_aton(addr[0]), 'little'):08X}:{addr[1]:04X}"


@dataclass(frozen=True)
class Poured:
    accepted: int
    # What the server process read of it (accepted less what the kernel still queues).
    read: int
    last_progress: float
    # When the write side broke (reset, broken pipe): the server closed the connection.
    broken_at: float | None
    # The buffer still held bytes at the end (the server was not reading them).
    backed_up: bool
    ended: float

    def stalled_since(self, stall_s: float) -> float | None:
        if self.broken_at is None and self.backed_up and self.ended - self.last_progress >= stall_s:
            return self.last_progress
        return None


def flood_outcome(poured: Poured, start: float, ran: float, stall_s: float, unit: str, size: int) -> Outcome:
    """A flood's outcome: cut off when the server broke the connection or stopped reading for
    good; otherwise it took every `unit` (of `size` bytes) it was sent."""
    taken = poured.accepted // size
    detail = {f"{unit}_taken": float(taken), "bytes_read": float(poured.read)}
    if poured.broken_at is not None:
        return Outcome(poured.accepted, poured.broken_at - start, "closed", ran, detail)
    stalled = poured.stalled_since(stall_s)
    if stalled is not None:
        return Outcome(poured.accepted, stalled - start, "stalled (stopped reading)", ran, detail)
    return Outcome(poured.accepted, None, f"the server took all {taken:,} {unit}", ran, detail)


async def connect(host: str, port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A loopback TCP connection; `rcvbuf` caps its receive buffer (a client that does not
    read lets the server's answers back up after that many bytes, not after megabytes)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def pour(writer: asyncio.StreamWriter, chunk: bytes, max_bytes: int, deadline: float,
               stop: asyncio.Event | None = None) -> Poured:
    transport = writer.transport
    transport.set_write_buffer_limits(high=4 * len(chunk))
    sock = transport.get_extra_info("socket")
    written = accepted = read = 0
    last_progress = checked = time.monotonic()

    def progress(force: bool = False) -> None:
        """Take stock (at most every POLL_S unless forced): /proc/net/tcp is not free."""
        nonlocal accepted, read, last_progress, checked
        now = time.monotonic()
        if now - checked < POLL_S and not force:
            return
        checked = now
        accepted = written - transport.get_write_buffer_size()
        with contextlib.suppress(OSError):  # closed: what it read last stands
            now_read = accepted - unread_bytes(sock)
            if now_read > read:
                read, last_progress = now_read, now

    broken_at: float | None = None
    while written < max_bytes and time.monotonic() < deadline and not (stop and stop.is_set()):
        writer.write(chunk)
        written += len(chunk)
        drained = asyncio.ensure_future(writer.drain())
        try:
            while not drained.done():
                await asyncio.wait({drained}, timeout=POLL_S)
                progress()
                if time.monotonic() >= deadline or (stop and stop.is_set()):
                    break
            if drained.done():
                drained.result()
            progress()
        except (ConnectionError, OSError):
            broken_at = time.monotonic()
            break
        finally:
            drained.cancel()
    progress(force=True)
    backed_up = broken_at is None and (transport.get_write_buffer_size() > 0 or accepted > read)
    return Poured(accepted, read, last_progress, broken_at, backed_up, time.monotonic())


async def hold(deadline: float) -> None:
    """Keep what is open open until `deadline` (monotonic)."""
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))


async def close(writer: asyncio.StreamWriter) -> None:
    """Close without waiting on a peer that may never read: abort what is still buffered."""
    writer.transport.abort()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (ConnectionError, OSError, TimeoutError):
        pass
