"""Publishes the engine's KV cache events on ZMQ exactly as vLLM's ``ZmqEventPublisher``
does, so KV-aware routers and indexers written for vLLM consume a Meridian node unchanged.

Wire protocol (see meridian.kv_events for the payload):

* PUB socket: multipart ``[topic, seq (8-byte big-endian), msgpack(KVEventBatch)]``;
  seq counts batches from 0 without gaps, so a subscriber detects what it missed.
* ROUTER replay socket (optional): a request ``[identity, b"", start_seq]`` is answered
  with ``[identity, b"", seq, payload]`` for every buffered batch with seq >= start_seq,
  then ``[identity, b"", END_SEQ, b""]``.

The engine calls ``publish`` from its own thread on every step, so publishing only
appends to a bounded in-memory queue; a background thread owns the sockets (ZMQ sockets
must not be shared between threads), encodes, sends and answers replay requests.

Its windows (how often drops are logged, how long close() flushes) are measured on the
publisher's `Clock` (the node's); only monotonic time is read, which is safe from the
publisher thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from typing import Generic, TypeVar

import msgspec
import zmq

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.kv_events import END_SEQ, KVEventBatch, encode_batch, seq_from_bytes, seq_to_bytes
from meridian.settings.node import NodeSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often, at most, dropped batches are reported in the log.
_DROP_LOG_INTERVAL_S = 10.0
# How long the constructor waits for the sockets to be bound or connected.
_SETUP_TIMEOUT_S = 10.0


class KVEventPublisherError(RuntimeError):
    """The publisher's sockets could not be set up (bad endpoint, address in use...)."""


class DropOldestQueue(Generic[T]):
    """A bounded, thread-safe FIFO whose `put` never blocks: when full, the oldest item
    makes room for the new one. Losing the oldest events is the better failure: a
    consumer that sees a gap in sequence numbers replays it, while a stalled engine
    step would slow every request on the node."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self._items: collections.deque[T] = collections.deque()
        self._maxsize = maxsize
        self._lock = threading.Lock()

    def put(self, item: T) -> tuple[bool, bool]:
        """Append `item`; returns (the queue was empty before, an old item was dropped)."""
        with self._lock:
            was_empty = not self._items
            dropped = len(self._items) >= self._maxsize
            if dropped:
                self._items.popleft()
            self._items.append(item)
            return was_empty, dropped

    def take_all(self) -> list[T]:
        """Remove and return everything queued, oldest first."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            return items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _should_bind(endpoint: str) -> bool:
    # vLLM's convention, kept so the same endpoint strings mean the same thing here: a
    # wildcard or a local transport is the stable side and binds; a host:port connects
    # to a collector that bound it (one indexer, many engines).
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class ZmqEventPublisher:
    """KV event sink that publishes batches on a ZMQ PUB socket, vLLM-compatible.

    `buffer_steps` batches are kept for replay; `max_queue_size` batches may wait to be
    sent before the oldest is dropped; `hwm` is the PUB socket's high-water mark.
    `data_parallel_rank` fills the batches that carry none, as vLLM's publisher does.
    Batches handed to `publish` belong to the publisher from then on: do not mutate them.
    """

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = 0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        self._clock = clock
        self._requested_endpoint = endpoint
        self._requested_replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._buffer_steps = buffer_steps
        self._dp_rank = data_parallel_rank
        self._queue: DropOldestQueue[KVEventBatch] = DropOldestQueue(max_queue_size)

        self._stats_lock = threading.Lock()
        self._dropped = 0
        self._dropped_unlogged = 0
        self._last_drop_log = float("-inf")
        self._sent = 0
        self._closed = False
        # Touched by the publisher thread only.
        self._unsent_at_close = 0
        self._close_lock = threading.Lock()

        # The thread sleeps in zmq.Poller on the ROUTER socket and on this pipe;
        # `publish` writes one byte when the queue stops being empty to wake it.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Guards the pipe's file descriptors against reuse after close().
        self._pipe_lock = threading.Lock()
        self._pipe_open = True

        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self.endpoint: str = endpoint
        self.replay_endpoint: str | None = replay_endpoint
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        if not self._ready.wait(_SETUP_TIMEOUT_S):
            self._closed = True
            self._wake()
            raise KVEventPublisherError(f"KV event sockets not ready after {_SETUP_TIMEOUT_S:.0f}s")
        if self._setup_error is not None:
            self._thread.join(self.SHUTDOWN_TIMEOUT_S)
            self._close_pipe()
            raise KVEventPublisherError(
                f"cannot publish KV events on {endpoint!r}"
                + (f" / replay {replay_endpoint!r}" if replay_endpoint else "")
                + f": {self._setup_error}"
            ) from self._setup_error
        log.info(
            "publishing KV events on %s (%s)%s", self.endpoint,
            "bound" if _should_bind(endpoint) else "connected",
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
        )

    # --- engine side -----------------------------------------------------------------

    def publish(self, batch: KVEventBatch) -> None:
        """Queue `batch` for sending; thread-safe, never blocks."""
        if self._closed:
            with self._stats_lock:
                self._dropped += 1
            return
        was_empty, dropped = self._queue.put(batch)
        if dropped:
            self._count_drop()
        if was_empty:
            self._wake()

    @property
    def dropped(self) -> int:
        """Batches discarded because the queue was full or the publisher closed."""
        with self._stats_lock:
            return self._dropped

    @property
    def sent(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        with self._stats_lock:
            return self._sent

    def close(self) -> None:
        """Send what is queued and let it leave ZMQ's pipes, both within
        SHUTDOWN_TIMEOUT_S, then close the sockets; what is left then is dropped.
        Idempotent; blocks the caller up to about a second."""
        with self._close_lock:
            if self._closed and not self._thread.is_alive():
                return
            self._closed = True
        self._wake()
        # The thread gives up flushing after SHUTDOWN_TIMEOUT_S; the margin covers
        # closing sockets and terminating the context.
        self._thread.join(self.SHUTDOWN_TIMEOUT_S + 1.0)
        if self._thread.is_alive():
            log.warning("KV event publisher thread did not stop; leaving it behind")
            return
        self._close_pipe()

    def _count_drop(self) -> None:
        now = self._clock.monotonic()
        with self._stats_lock:
            self._dropped += 1
            self._dropped_unlogged += 1
            if now - self._last_drop_log < _DROP_LOG_INTERVAL_S:
                return
            self._last_drop_log = now
            count, self._dropped_unlogged = self._dropped_unlogged, 0
            total = self._dropped
        log.warning(
            "KV event queue full: dropped %d batches (%d in total); subscribers will see a gap",
            count, total,
        )

    def _wake(self) -> None:
        with self._pipe_lock:
            if not self._pipe_open:
                return
            # A full pipe already holds a pending wake-up.
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    def _close_pipe(self) -> None:
        with self._pipe_lock:
            if not self._pipe_open:
                return
            self._pipe_open = False
            os.close(self._wake_r)
            os.close(self._wake_w)

    # --- publisher thread ------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        pub: zmq.Socket[bytes] | None = None
        replay: zmq.Socket[bytes] | None = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.LINGER, 0)
                pub.set_hwm(self._hwm)
                if _should_bind(self._requested_endpoint):
                    pub.bind(self._requested_endpoint)
                    self.endpoint = _last_endpoint(pub, self._requested_endpoint)
                else:
                    pub.connect(self._requested_endpoint)
                if self._requested_replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    # A full replay must fit in the peer's pipe, or ZMQ silently drops
                    # its tail (END_SEQ included) and the client waits forever.
                    replay.set_hwm(self._buffer_steps + 1)
                    replay.bind(self._requested_replay_endpoint)
                    self.replay_endpoint = _last_endpoint(replay, self._requested_replay_endpoint)
            except Exception as exc:  # reported to the constructor
                self._setup_error = exc
                return
            finally:
                self._ready.set()
            try:
                self._loop(pub, replay)
            except Exception:  # a thread has nobody else to report to
                log.exception("KV event publisher stopped; events are no longer published")
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close()
            ctx.term()

    def _loop(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=self._buffer_steps)
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        seq = 0
        while not self._closed:
            events = dict(poller.poll())
            if self._wake_r in events:
                _drain(self._wake_r)
            if replay is not None and replay in events:
                self._serve_replays(replay, buffer)
            seq = self._send_queued(pub, buffer, seq)
        # Closing: send what was published before close(), within the shutdown deadline.
        deadline = self._clock.monotonic() + self.SHUTDOWN_TIMEOUT_S
        while len(self._queue) and self._clock.monotonic() < deadline:
            seq = self._send_queued(pub, buffer, seq, deadline)
        unsent = len(self._queue) + self._unsent_at_close
        if unsent:
            with self._stats_lock:
                self._dropped += unsent
            log.warning("KV event publisher closed with %d batches unsent", unsent)
        # What was sent may still sit in ZMQ's pipes: let it out for what remains of the
        # deadline (a plain linger 0 would discard the tail of the flush), no longer.
        pub.setsockopt(zmq.LINGER, max(0, int((deadline - self._clock.monotonic()) * 1000)))

    def _send_queued(
        self,
        pub: zmq.Socket[bytes],
        buffer: collections.deque[tuple[int, bytes]],
        seq: int,
        deadline: float | None = None,
    ) -> int:
        batches = self._queue.take_all()
        for i, batch in enumerate(batches):
            if deadline is not None and i % 64 == 0 and self._clock.monotonic() >= deadline:
                self._unsent_at_close += len(batches) - i
                break
            if batch.data_parallel_rank is None and self._dp_rank is not None:
                batch = msgspec.structs.replace(batch, data_parallel_rank=self._dp_rank)
            try:
                payload = encode_batch(batch)
            except Exception:  # one bad batch must not stop the stream
                log.exception("cannot encode a KV event batch; skipped")
                continue
            try:
                pub.send_multipart((self._topic, seq_to_bytes(seq), payload), copy=False)
            except zmq.ZMQError:
                # PUB never blocks (it drops at the high-water mark); an error here is a
                # broken socket. The batch still takes its seq and stays replayable.
                log.exception("cannot send KV event batch %d", seq)
            buffer.append((seq, payload))
            seq += 1
            with self._stats_lock:
                self._sent = seq
        return seq

    def _serve_replays(
        self, replay: zmq.Socket[bytes], buffer: collections.deque[tuple[int, bytes]]
    ) -> None:
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
                continue
            identity, _, start_raw = frames
            start = seq_from_bytes(start_raw)
            try:
                for seq, payload in buffer:
                    if seq >= start:
                        replay.send_multipart((identity, b"", seq_to_bytes(seq), payload), copy=False)
                replay.send_multipart((identity, b"", END_SEQ, b""))
            except zmq.ZMQError:
                log.exception("cannot answer a KV event replay request")


def _last_endpoint(sock: zmq.Socket[bytes], requested: str) -> str:
    """The endpoint a bind resolved to (the real port of `tcp://host:*`)."""
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    value = raw.decode() if isinstance(raw, bytes) else str(raw)
    return value or requested


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        while os.read(fd, 4096):
            pass


class NullEventPublisher:
    """A KV event sink that discards everything (events disabled)."""

    def publish(self, batch: KVEventBatch) -> None:
        """Discard `batch`."""

    def close(self) -> None:
        """Nothing to release."""


def create_publisher(settings: NodeSettings, *, clock: Clock = SYSTEM_CLOCK) -> ZmqEventPublisher | None:
    """The node's KV event publisher, or None when settings.kv_events_endpoint is unset."""
    if not settings.kv_events_endpoint:
        if settings.kv_events_replay_endpoint:
            log.warning("kv_events_replay_endpoint is set without kv_events_endpoint; KV events are off")
        return None
    return ZmqEventPublisher(
        settings.kv_events_endpoint,
        replay_endpoint=settings.kv_events_replay_endpoint,
        topic=settings.kv_events_topic,
        clock=clock,
    )
