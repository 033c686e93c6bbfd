"""A streamed answer once the router has committed to it, and the response that sends it.

Two kinds of stream sit behind one response class: a node's events passed through whole
(`PassThroughStream`: a break ends it with one error event), and a migratable stream
(geo_router.forwarding.migration.stream: a break resumes it on another replica). Either way the
upstream connection is released however the client leaves, and callbacks registered with
`when_stream_ends` (accounting, tracing, the access line) see the stream's tally once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import anyio
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from meridian.http_stream import ListenerStreamingResponse

from ..selection.candidates import Candidate
from ..sse import SSEFramer, StreamTally, error_event
from .upstream import FailureReason, UpstreamConnection, UpstreamError

log = logging.getLogger(__name__)


class CommittedStream(Protocol):
    """A streamed answer being sent: its bytes, what they carried, and how to let go of it."""

    tally: StreamTally
    on_close: list[Callable[[StreamTally], None]]

    def body(self) -> AsyncIterator[bytes]: ...

    async def close(self) -> None: ...


class StreamHost(Protocol):
    """What a committed stream needs from the forwarder that opened it."""

    read_timeout_s: float

    def note_failure(self, candidate: Candidate, reason: FailureReason) -> None: ...

    def release(self, conn: UpstreamConnection) -> None: ...

    def finish(self, candidate: Candidate, elapsed_s: float) -> None: ...

    def end_request(self) -> None: ...


def when_stream_ends(response: Response, callback: Callable[[StreamTally], None]) -> bool:
    """Call `callback` with the stream's tally once a streamed answer is over (however it
    ended); False, and no call, when `response` is not a passed-through stream."""
    if not isinstance(response, UpstreamStreamingResponse):
        return False
    response.upstream.on_close.append(callback)
    return True


class PassThroughStream:
    """A committed streamed answer: its node's connection, and how to pass it on and close it."""

    def __init__(
        self,
        host: StreamHost,
        candidate: Candidate,
        conn: UpstreamConnection,
        framer: SSEFramer,
        first: bytes,
        ended: bool,
        deadline: float,
        received_at: float,
    ) -> None:
        self._host = host
        self._candidate = candidate
        self._conn = conn
        self._framer = framer
        self._first = first
        self._ended = ended
        self._deadline = deadline
        self._received_at = received_at
        self._closed = False
        self.tally = StreamTally()
        self.on_close: list[Callable[[StreamTally], None]] = []

    async def body(self) -> AsyncIterator[bytes]:
        if self._first:
            self.tally.feed(self._first)
            yield self._first
        if self._ended:
            return
        loop = asyncio.get_running_loop()
        read_timeout_s = self._host.read_timeout_s
        while True:
            try:
                chunk = await self._conn.read_chunk_by(min(self._deadline, loop.time() + read_timeout_s))
            except (UpstreamError, TimeoutError) as exc:
                reason = exc.reason if isinstance(exc, UpstreamError) else FailureReason.TIMEOUT
                node = self._candidate.node.node_id
                log.warning("node %s broke a stream (%s: %s)", node, reason, exc)
                self._host.note_failure(self._candidate, FailureReason.MIDSTREAM)
                yield error_event(
                    f"The model server stopped responding in the middle of the answer ({reason}).",
                    "upstream_disconnected",
                )
                return
            if not chunk:
                tail = self._framer.flush()
                if tail:
                    self.tally.feed(tail)
                    yield tail
                return
            out = self._framer.feed(chunk)
            if out:
                self.tally.feed(out)
                yield out

    async def close(self) -> None:
        """Release the upstream connection (also when the client went away); idempotent."""
        if self._closed:
            return
        self._closed = True
        # A body not read to its end closes the connection instead of pooling it, which is
        # also what tells the node to stop generating.
        self._host.release(self._conn)
        self._host.finish(self._candidate, time.perf_counter() - self._received_at)
        self._host.end_request()
        run_close_callbacks(self.on_close, self.tally)


def run_close_callbacks(callbacks: list[Callable[[StreamTally], None]], tally: StreamTally) -> None:
    for callback in callbacks:
        try:
            callback(tally)
        except Exception:  # bookkeeping must not break the connection's release
            log.exception("stream close callback failed")


class UpstreamStreamingResponse(ListenerStreamingResponse):
    """A StreamingResponse that always closes its upstream, however the client leaves."""

    def __init__(self, stream: CommittedStream, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(stream.body(), status_code=status_code, headers=headers)
        self.upstream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # On meridian's listener a hang-up cancels the stream: no task per stream watching
            # receive() (meridian.http_stream).
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                body = self.body_iterator
                if hasattr(body, "aclose"):
                    await body.aclose()
                await self.upstream.close()
