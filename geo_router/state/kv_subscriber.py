"""Keeps the KV index (geo_router.state.kv_index) fed from every node's KV cache event stream.

One ZMQ SUB connection per node that advertises `kv_events` in the routing table,
following the table as it changes (`on_table`): new nodes are subscribed to, removed
nodes (and nodes whose endpoints changed) are disconnected and forgotten by the index.
The wire protocol is the publisher's (data_plane.kv_events.publisher, vLLM's):
``[topic, seq, msgpack(KVEventBatch)]`` with seq counting batches from 0 without gaps,
plus an optional ROUTER replay socket that resends buffered batches from a given seq.

Consistency rules, per node (the index must never believe a node holds a block it
dropped, or affinity sends requests to a cold cache):

* a sequence gap is filled from the node's replay socket when it has one; batches that
  cannot be recovered (no replay, replay too short or silent) clear the node's entries,
  because a lost batch may have removed blocks. What arrives afterwards is applied to
  the empty entry, which again only ever under-states what the node holds;
* a batch whose frames are well formed but whose payload does not decode counts as lost;
  a message that is not three frames with an 8-byte seq is ignored. Both are counted and
  logged at most every few seconds;
* a publisher that starts again (a restarted node counts from seq 0) is detected by its
  seq going backwards and by the connection dropping (a ZMQ socket monitor): both reset
  the node (entries cleared, seq unknown). On (re)connecting, what the publisher still
  buffers is replayed when `kv_events_replay_on_connect`, so a router that subscribes
  late, or after a restart, learns the blocks cached before it listened. One restart goes
  unseen: behind a forwarder (the router's connection never drops), a new stream whose
  first batch to come through is already past where the old one stopped reads as a gap,
  which the replay fills from the new stream. The node's old entries then stay until its
  events remove them, so routing may prefer it for blocks it no longer holds: a miss, not
  a wrong answer. vLLM's batches carry no publisher identity to tell the two apart.

Threading: ZMQ sockets must stay on one thread, so one background thread owns every
socket (a zmq.Poller over the SUB, replay and monitor sockets plus a wake-up pipe) and
applies decoded batches to the index; the event loop only posts table updates through a
queue. Doing the decoding there keeps it off the event loop, which serves requests. The
index takes a lock per batch and per match, so the event loop reads it while it is
updated. Replays never block the thread: replies are read as they arrive, while live
batches of that node wait in a bounded list. Replay deadlines and the warnings' throttle
are on the router's `Clock` (the thread only reads its monotonic time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.kv_events import END_SEQ, decode_batch, seq_from_bytes, seq_to_bytes
from meridian.settings.router import RouterSettings

from .kv_index import KVIndex
from .kv_scope import KVScope
from .table import LoadedTable

log = logging.getLogger(__name__)

# Messages read from one socket before the others get a turn.
_BURST = 256
# Live batches of one node held while its replay is running; beyond this the replay is
# abandoned (the node publishes faster than it replays).
_MAX_PENDING = 100_000
# Repeated warnings (decode errors, lost batches) are logged at most this often.
_LOG_INTERVAL_S = 10.0
_STOP_TIMEOUT_S = 5.0
# SUB receive buffer, as the node relay's: a burst must not be dropped by ZMQ itself.
_RCVHWM = 100_000
# Reconnect backoff towards a node that is gone, and ZMTP heartbeats, so that a peer that
# vanished without closing its connection is noticed (and its entries cleared).
_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 5_000
_HEARTBEAT_IVL_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 15_000
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED

# (events endpoint, replay endpoint or None) by node id.
Endpoints = Mapping[str, tuple[str, str | None]]


@dataclass(slots=True)
class KVSubscriberStats:
    """Counters for metrics (written by the subscriber thread only, read from anywhere)."""

    batches: int = 0  # batches applied to the index, live and replayed
    events: int = 0  # events in those batches
    gaps: int = 0  # sequence gaps seen in live streams
    replays: int = 0  # replay requests sent (gaps and (re)connects)
    replayed_batches: int = 0  # batches recovered through replays
    replay_failures: int = 0  # replays that timed out or could not be sent
    lost_batches: int = 0  # batches never recovered (each time, the node's entries were cleared)
    resets: int = 0  # publishers that restarted or connections that dropped
    decode_errors: int = 0  # malformed messages and undecodable payloads


class _Throttle:
    """Lets a repeated warning through at most once per interval, counting the rest."""

    def __init__(self, clock: Clock, interval_s: float = _LOG_INTERVAL_S) -> None:
        self._clock = clock
        self._interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0

    def allow(self) -> int | None:
        """None to stay silent, else how many were suppressed since the last one logged."""
        now = self._clock.monotonic()
        if now - self._last < self._interval_s:
            self._suppressed += 1
            return None
        self._last = now
        count, self._suppressed = self._suppressed, 0
        return count


@dataclass(eq=False, slots=True)
class _Conn:
    """One node's subscription, as the subscriber thread tracks it."""

    node_id: str
    endpoint: str
    replay_endpoint: str | None
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    replay: zmq.Socket[bytes] | None = None
    # Next seq expected; None: nothing received since (re)connecting.
    expected: int | None = None
    # A replay in flight: True while one runs; it covers seqs below replay_until (None: all
    # the publisher buffers), and is given up at replay_deadline (moved on by each reply).
    replaying: bool = False
    replay_until: int | None = None
    replay_deadline: float = 0.0
    # Live batches received while the replay runs, in arrival order.
    pending: list[tuple[int, bytes]] = field(default_factory=list)
    # Cleared when the replay endpoint cannot even be connected to.
    replay_usable: bool = True

    @property
    def can_replay(self) -> bool:
        return self.replay_endpoint is not None and self.replay_usable


class KVEventSubscriber:
    """Subscribes to the KV events of every node of the routing table in `scope` (every node
    unless kv_events_max_rtt_ms bounds it) and feeds `index`.

    Register `on_table` with the table source (`TableSource.add_listener`); `start()` and
    `stop()` from the event loop. Tables seen before `start()` are applied when it runs.
    """

    def __init__(
        self, settings: RouterSettings, index: KVIndex, *, clock: Clock = SYSTEM_CLOCK, scope: KVScope | None = None,
    ) -> None:
        self.index = index
        # Whose events are followed: the nodes of the regions in scope (geo_router.state.kv_scope).
        self.scope = scope if scope is not None else KVScope(settings)
        self._clock = clock
        self.stats = KVSubscriberStats()
        self._settings = settings
        self._topic = settings.kv_events_topic.encode("utf-8")
        self._replay_timeout_s = settings.kv_events_replay_timeout_s
        self._replay_on_connect = settings.kv_events_replay_on_connect
        self._wanted: dict[str, tuple[str, str | None]] | None = None
        self._version: int | None = None  # of the table followed last
        self._control: queue.SimpleQueue[dict[str, tuple[str, str | None]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._wake_r = self._wake_w = -1
        # Node ids subscribed to now; replaced whole by the thread, so reading it is safe.
        self._subscribed: frozenset[str] = frozenset()

    # --- event loop side ---------------------------------------------------------------

    def on_table(self, loaded: LoadedTable) -> None:
        """Follow a new routing table (a TableSource listener: cheap, never blocks).

        A table a delta led to from the one followed last is looked at only for the nodes the
        delta changed; any other table over every node.
        """
        changed = loaded.changes_since(self._version)
        self._version = loaded.version
        rescoped = self.scope.update(loaded)
        if changed is None or self._wanted is None or rescoped:
            covers = self.scope.covers
            wanted = {n.node_id: (n.kv_events, n.kv_events_replay)
                      for n in loaded.table.nodes if n.kv_events and covers(n)}
        else:
            wanted = self._wanted_after(loaded, changed)
        if wanted == self._wanted:
            return
        self._wanted = wanted
        self._control.put(wanted)  # the thread's own dict: never changed once put
        self._wake()

    def _wanted_after(self, loaded: LoadedTable, changed: frozenset[str]) -> dict[str, tuple[str, str | None]]:
        """The endpoints wanted now: those followed last, changed where `changed` says."""
        assert self._wanted is not None
        updates: dict[str, tuple[str, str | None] | None] = {}
        for node_id in changed:
            node = loaded.nodes_by_id.get(node_id)
            follow = node is not None and bool(node.kv_events) and self.scope.covers(node)
            endpoints = (node.kv_events, node.kv_events_replay) if follow else None
            if self._wanted.get(node_id) != endpoints:
                updates[node_id] = endpoints
        if not updates:
            return self._wanted
        wanted = dict(self._wanted)
        for node_id, endpoints in updates.items():
            if endpoints is None:
                del wanted[node_id]
            else:
                wanted[node_id] = endpoints
        return wanted

    def subscribed_nodes(self) -> frozenset[str]:
        """Nodes whose event stream the subscriber is connected to (or connecting to) now."""
        return self._subscribed

    async def start(self) -> None:
        """Start the subscriber thread (idempotent)."""
        if self._thread is not None:
            return
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        if self._wanted is not None:
            # An earlier run consumed the table updates; the new thread starts from none.
            self._control.put(self._wanted)
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread and close every socket; returns within a few seconds at most."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping = True
        self._wake()
        await asyncio.to_thread(thread.join, _STOP_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the KV event subscriber thread did not stop within %.0fs", _STOP_TIMEOUT_S)
            return  # it still polls the pipe: leave it open for the daemon thread
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        if self._wake_w < 0:
            return  # not started: start() reads the queue anyway
        # A full pipe already holds a pending wake-up.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # --- subscriber thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            worker = _Worker(self)
        except Exception:
            log.exception("the KV event subscriber could not start; the KV index stays empty")
            return
        try:
            worker.run()
        except Exception:  # a thread has nobody else to report to
            log.exception("the KV event subscriber stopped; the KV index is no longer updated")
        finally:
            worker.close()

    def _take_control(self) -> dict[str, tuple[str, str | None]] | None:
        """The newest table update posted since the last call, if any."""
        latest = None
        with contextlib.suppress(queue.Empty):
            while True:
                latest = self._control.get_nowait()
        return latest


class _Worker:
    """The subscriber thread's state: the ZMQ context, poller and connections."""

    def __init__(self, owner: KVEventSubscriber) -> None:
        self._owner = owner
        self._index = owner.index
        self._stats = owner.stats
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._poller = zmq.Poller()
        self._poller.register(owner._wake_r, zmq.POLLIN)
        self._conns: dict[str, _Conn] = {}
        # Socket -> (connection, handler) for every socket registered besides the pipe.
        self._handlers: dict[zmq.Socket[bytes], tuple[_Conn, Callable[[_Conn], None]]] = {}
        self._clock = owner._clock
        self._decode_log = _Throttle(owner._clock)
        self._lost_log = _Throttle(owner._clock)

    def run(self) -> None:
        owner = self._owner
        while not owner._stopping:
            self._apply_table(owner._take_control())
            ready = dict(self._poller.poll(self._poll_timeout_ms()))
            if owner._wake_r in ready:
                _drain(owner._wake_r)
            for sock in ready:
                handler = self._handlers.get(sock)
                if handler is not None:
                    conn, handle = handler
                    handle(conn)
            self._expire_replays()

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._disconnect(conn, forget=False)
        self._owner._subscribed = frozenset()
        self._ctx.term()

    # --- table -------------------------------------------------------------------------

    def _apply_table(self, wanted: Endpoints | None) -> None:
        if wanted is None:
            return
        for node_id, conn in list(self._conns.items()):
            if wanted.get(node_id) != (conn.endpoint, conn.replay_endpoint):
                self._disconnect(conn, forget=True)
        for node_id, (endpoint, replay) in wanted.items():
            if node_id not in self._conns:
                self._connect(node_id, endpoint, replay)
        self._owner._subscribed = frozenset(self._conns)

    def _connect(self, node_id: str, endpoint: str, replay: str | None) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, _RCVHWM)
        sub.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self._owner._topic)
        # Before connect(), so the first connection is reported too.
        monitor = sub.get_monitor_socket(_MONITORED)
        try:
            sub.connect(endpoint)
        except zmq.ZMQError as exc:
            log.warning("cannot subscribe to the KV events of node %s at %s: %s", node_id, endpoint, exc)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            return
        # A fresh subscription starts from nothing, whatever an earlier one left behind.
        self._index.remove_node(node_id)
        conn = _Conn(node_id=node_id, endpoint=endpoint, replay_endpoint=replay, sub=sub, monitor=monitor)
        self._conns[node_id] = conn
        self._register(sub, conn, self._on_sub)
        self._register(monitor, conn, self._on_monitor)
        log.info("subscribed to the KV events of node %s at %s", node_id, endpoint)

    def _disconnect(self, conn: _Conn, *, forget: bool) -> None:
        self._close_replay(conn)
        conn.sub.disable_monitor()
        for sock in (conn.monitor, conn.sub):
            self._unregister(sock)
            sock.close(linger=0)
        self._conns.pop(conn.node_id, None)
        if forget:
            self._index.remove_node(conn.node_id)
            log.info("unsubscribed from the KV events of node %s", conn.node_id)

    def _register(self, sock: zmq.Socket[bytes], conn: _Conn, handle: Callable[[_Conn], None]) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = (conn, handle)

    def _unregister(self, sock: zmq.Socket[bytes]) -> None:
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    # --- live stream -------------------------------------------------------------------

    def _on_sub(self, conn: _Conn) -> None:
        for _ in range(_BURST):
            try:
                frames = conn.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self._decode_error(conn, f"a message of {len(frames)} frames")
                continue
            seq, payload = seq_from_bytes(frames[1]), frames[2]
            if conn.replaying:
                conn.pending.append((seq, payload))
                if len(conn.pending) > _MAX_PENDING:
                    self._replay_failed(conn, "too many live batches waiting for it")
                continue
            self._on_batch(conn, seq, payload, may_replay=True)

    def _on_batch(self, conn: _Conn, seq: int, payload: bytes, *, may_replay: bool) -> None:
        """Apply a live batch in sequence order, repairing or clearing on a gap."""
        expected = conn.expected
        if expected is not None and seq < expected:
            # The publisher counts from 0 again: the node (or its engine) restarted.
            self._reset(conn, f"its sequence went back from {expected} to {seq}")
            expected = None
        if expected is None:
            if seq > 0 and may_replay and conn.can_replay and self._owner._replay_on_connect:
                self._start_replay(conn, 0, until=seq, first=(seq, payload))
                return
            expected = seq
        if seq > expected:
            self._stats.gaps += 1
            if may_replay and conn.can_replay:
                self._start_replay(conn, expected, until=seq, first=(seq, payload))
                return
            self._lost(conn, expected, seq)
        self._apply(conn, seq, payload)

    def _apply(self, conn: _Conn, seq: int, payload: bytes) -> None:
        conn.expected = seq + 1
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            self._decode_error(conn, f"batch {seq}: {exc}")
            # The batch may have removed blocks: the node's entries cannot be trusted.
            self._index.clear_node(conn.node_id)
            return
        self._index.apply(conn.node_id, batch.events)
        self._stats.batches += 1
        self._stats.events += len(batch.events)

    def _lost(self, conn: _Conn, start: int, end: int) -> None:
        """Batches start..end-1 will never arrive: forget what the node was believed to hold."""
        self._stats.lost_batches += end - start
        self._index.clear_node(conn.node_id)
        suppressed = self._lost_log.allow()
        if suppressed is not None:
            log.warning(
                "lost KV event batches %d..%d of node %s; its index entries were cleared%s",
                start, end - 1, conn.node_id, _also(suppressed),
            )

    def _reset(self, conn: _Conn, why: str) -> None:
        self._stats.resets += 1
        log.info("KV event stream of node %s starts over (%s)", conn.node_id, why)
        self._abandon_replay(conn)
        conn.expected = None
        self._index.clear_node(conn.node_id)

    def _on_monitor(self, conn: _Conn) -> None:
        for _ in range(_BURST):
            try:
                event = recv_monitor_message(conn.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # Whatever the node did while unreachable is unknown; a restart looks like this too.
                self._reset(conn, "its connection dropped")
            elif event["event"] == zmq.EVENT_CONNECTED:
                if conn.expected is None and not conn.replaying and conn.can_replay and (
                    self._owner._replay_on_connect
                ):
                    self._start_replay(conn, 0, until=None, first=None)

    def _decode_error(self, conn: _Conn, what: str) -> None:
        self._stats.decode_errors += 1
        suppressed = self._decode_log.allow()
        if suppressed is not None:
            log.warning("ignoring a malformed KV event message from node %s: %s%s", conn.node_id, what,
                        _also(suppressed))

    # --- replay --------------------------------------------------------------------------

    def _start_replay(self, conn: _Conn, start: int, *, until: int | None, first: tuple[int, bytes] | None) -> None:
        """Ask the node's replay socket for batches from `start`; live batches wait meanwhile."""
        assert conn.replay_endpoint is not None
        if conn.replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # The publisher sends a whole replay at once; ZMQ must not drop its tail.
            sock.setsockopt(zmq.RCVHWM, 0)
            try:
                sock.connect(conn.replay_endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                log.warning("cannot connect to the KV event replay of node %s at %s: %s",
                            conn.node_id, conn.replay_endpoint, exc)
                conn.replay_usable = False  # until a table update changes the endpoint
                self._settle_without_replay(conn, first)
                return
            conn.replay = sock
            self._register(sock, conn, self._on_replay)
        self._stats.replays += 1
        conn.replaying = True
        conn.replay_until = until
        conn.replay_deadline = self._clock.monotonic() + self._owner._replay_timeout_s
        conn.pending = [first] if first is not None else []
        try:
            # The ROUTER expects [identity, empty, start seq]; DEALER adds the identity.
            conn.replay.send_multipart((b"", seq_to_bytes(start)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._replay_failed(conn, f"the request could not be sent ({exc})")

    def _settle_without_replay(self, conn: _Conn, first: tuple[int, bytes] | None) -> None:
        if first is not None:
            self._on_batch(conn, *first, may_replay=False)

    def _on_replay(self, conn: _Conn) -> None:
        sock = conn.replay
        for _ in range(_BURST):
            if sock is None or conn.replay is not sock:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not conn.replaying:
                continue  # nothing asked for (cannot happen: an abandoned replay closes the socket)
            if len(frames) != 3 or len(frames[1]) != 8:
                self._decode_error(conn, f"a replay message of {len(frames)} frames")
                continue
            conn.replay_deadline = self._clock.monotonic() + self._owner._replay_timeout_s
            if frames[1] == END_SEQ:
                self._finish_replay(conn)
                continue
            self._on_replayed(conn, seq_from_bytes(frames[1]), frames[2])

    def _on_replayed(self, conn: _Conn, seq: int, payload: bytes) -> None:
        if conn.replay_until is not None and seq >= conn.replay_until:
            return  # the live batches held in `pending` cover it
        if conn.expected is None:
            conn.expected = seq  # catching up: whatever history the publisher still has
        if seq < conn.expected:
            return  # a batch already applied
        if seq > conn.expected:
            self._lost(conn, conn.expected, seq)
        self._stats.replayed_batches += 1
        self._apply(conn, seq, payload)

    def _finish_replay(self, conn: _Conn) -> None:
        """Apply the live batches held back, as if they had just arrived."""
        until = conn.replay_until
        conn.replaying = False
        conn.replay_until = None
        pending, conn.pending = conn.pending, []
        for i, (seq, payload) in enumerate(pending):
            if conn.replaying:
                conn.pending.append((seq, payload))  # a new replay started: keep the order
                continue
            if until is None and conn.expected is not None and seq < conn.expected:
                continue  # an open-ended replay already delivered it
            # The first one revealed the gap just tried: what the replay lacked is lost.
            self._on_batch(conn, seq, payload, may_replay=i > 0)

    def _replay_failed(self, conn: _Conn, why: str) -> None:
        self._stats.replay_failures += 1
        log.warning("KV event replay from node %s failed: %s", conn.node_id, why)
        # Late replies would be read as answers to the next request.
        self._close_replay(conn)
        self._finish_replay(conn)

    def _abandon_replay(self, conn: _Conn) -> None:
        """Drop a replay in flight and the batches held for it (the stream starts over)."""
        if conn.replaying:
            self._close_replay(conn)
            conn.replaying = False
            conn.replay_until = None
            conn.pending = []

    def _close_replay(self, conn: _Conn) -> None:
        if conn.replay is not None:
            self._unregister(conn.replay)
            conn.replay.close(linger=0)
            conn.replay = None

    def _expire_replays(self) -> None:
        now = self._clock.monotonic()
        for conn in list(self._conns.values()):
            if conn.replaying and now >= conn.replay_deadline:
                self._replay_failed(conn, f"no answer within {self._owner._replay_timeout_s:g}s")

    def _poll_timeout_ms(self) -> int | None:
        deadlines = [c.replay_deadline for c in self._conns.values() if c.replaying]
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - self._clock.monotonic()) * 1000) + 1)


def _also(suppressed: int) -> str:
    return f" ({suppressed} more since the last report)" if suppressed else ""


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        while os.read(fd, 4096):
            pass
