"""Relay vLLM's KV cache events to the node's KVEventSink.

A dedicated thread owns a ZMQ SUB socket bound on loopback (vLLM's publisher connects
to it, so the socket outlives vLLM restarts), decodes each message and hands the batch
to the sink. Sequence gaps are filled from vLLM's replay socket when it has one. When a
vLLM process ends, its cache is gone: the relay first delivers what that process had
already sent, then publishes AllBlocksCleared. Batches that cannot be recovered are
followed by AllBlocksCleared too: a lost batch may have removed blocks, and downstream
consumers could not tell (the node's own publisher numbers its batches afresh).

Blocks are re-keyed by Meridian's chained hash of their tokens on the way (rehash.py),
so that routers match vLLM nodes exactly.

vLLM's payload layout changed over releases: events were positional arrays (5 fields,
then `medium`, then `lora_name`, later more trailing fields) until vLLM switched the
events to maps keyed by field name with the tag under "type" (vllm-project/vllm#42892).
`decode_vllm_batch` accepts all of these and returns Meridian's (vLLM-compatible)
KVEventBatch.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import msgspec
import zmq

from data_plane.engine.base import KVEventSink
from data_plane.engine.vllm.rehash import BlockRehasher
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.kv_events import END_SEQ, AllBlocksCleared, KVEventBatch, decode_batch

log = logging.getLogger(__name__)

# Positional field order of each event in vLLM's array encoding (after the tag).
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_POLL_MS = 50
# How long to wait for vLLM's replay socket to answer a gap request.
_REPLAY_TIMEOUT_S = 1.0


class KVEventDecodeError(ValueError):
    """A payload is not a vLLM KV event batch in any known layout."""


def _canonical_event(raw: Any) -> list[Any] | None:
    """[tag, *fields] in Meridian's layout, or None for an event type we do not know."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            return None
        return [tag, *(raw.get(name) for name in fields)]
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        fields = _FIELDS.get(raw[0])
        if fields is None:
            return None
        values = list(raw[1 : 1 + len(fields)])
        # Older vLLM sent fewer trailing fields (no medium, no lora_name).
        values += [None] * (len(fields) - len(values))
        return [raw[0], *values]
    raise KVEventDecodeError(f"unexpected event shape {type(raw).__name__}")


def decode_vllm_batch(payload: bytes) -> KVEventBatch:
    """Decode one vLLM KV event payload, whichever vLLM release produced it."""
    try:
        return decode_batch(payload)
    except msgspec.DecodeError:
        pass
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise KVEventDecodeError("not an event batch")
    if not isinstance(events, list):
        raise KVEventDecodeError("the batch has no event list")
    canonical = [e for e in (_canonical_event(ev) for ev in events) if e is not None]
    try:
        return msgspec.convert([ts, canonical, rank], KVEventBatch)
    except msgspec.ValidationError as exc:
        raise KVEventDecodeError(str(exc)) from exc


class KVEventRelay:
    """Subscribes to vLLM's KV events and publishes them to a KVEventSink (thread-safe)."""

    def __init__(
        self,
        bind_endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.bind_endpoint = bind_endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._clock = clock
        self._sink: KVEventSink | None = None
        self._ctx = zmq.Context()
        self._sub: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._control: queue.SimpleQueue[str] = queue.SimpleQueue()
        # Sequence number expected next from the current vLLM process; None: any.
        self._expected: int | None = None
        self.rehasher = BlockRehasher()
        # Counters (read from other threads; ints are replaced atomically).
        self.batches = 0
        self.decode_errors = 0
        self.missed = 0
        self.replayed = 0

    def set_sink(self, sink: KVEventSink | None) -> None:
        self._sink = sink

    def start(self) -> None:
        """Bind the SUB socket (raises zmq.ZMQError if the address is taken) and start the thread."""
        if self._thread is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        try:
            sub.bind(self.bind_endpoint)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._sub = sub
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-relay", daemon=True)
        self._thread.start()

    def child_exited(self) -> None:
        """The vLLM process ended: deliver what it sent, then publish AllBlocksCleared."""
        self._control.put("cleared")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the sockets (blocking; call it off the event loop)."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                # term() would block on its open socket; the daemon thread dies with us.
                log.warning("the KV event relay thread did not stop within %.0fs", timeout_s)
                return
        self._ctx.term()

    # --- relay thread ----------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        replay: zmq.Socket[bytes] | None = None
        try:
            while not self._stop.is_set():
                self._apply_control(sub)
                if sub.poll(_POLL_MS) == 0:
                    continue
                replay = self._handle(sub.recv_multipart(), replay)
            self._apply_control(sub)
        except Exception:
            log.exception("the KV event relay stopped")
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _apply_control(self, sub: zmq.Socket[bytes]) -> None:
        while True:
            try:
                command = self._control.get_nowait()
            except queue.Empty:
                return
            if command == "cleared":
                # Whatever is queued came from the process that just ended.
                while sub.poll(0):
                    self._handle(sub.recv_multipart(), None)
                self._cleared()
                self._expected = None

    def _handle(self, frames: list[bytes], replay: zmq.Socket[bytes] | None) -> zmq.Socket[bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.decode_errors += 1
            log.warning("ignoring a KV event message with %d frames", len(frames))
            return replay
        seq = int.from_bytes(frames[1], "big")
        expected = self._expected
        if expected is not None and seq < expected:
            if seq != 0:
                return replay  # a duplicate (vLLM delivers at least once)
            expected = None  # a new vLLM process we were not told about
        if expected is not None and seq > expected:
            replay = self._fill_gap(expected, seq, replay)
        self._expected = seq + 1
        self._deliver(frames[2])
        return replay

    def _fill_gap(self, start: int, end: int, replay: zmq.Socket[bytes] | None) -> zmq.Socket[bytes] | None:
        got: dict[int, bytes] = {}
        if self.replay_endpoint is not None:
            if replay is None:
                replay = self._ctx.socket(zmq.DEALER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.connect(self.replay_endpoint)
            # vLLM's ROUTER expects [identity, empty, start seq]; a DEALER adds the identity.
            replay.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = self._clock.monotonic() + _REPLAY_TIMEOUT_S
            complete = False
            while not complete and self._clock.monotonic() < deadline:
                if not replay.poll(max(1, int((deadline - self._clock.monotonic()) * 1000))):
                    break
                frames = replay.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    complete = True
                    continue
                seq = int.from_bytes(frames[1], "big")
                if start <= seq < end:
                    got[seq] = frames[2]
            if not complete:
                # Late replies would be read as answers to the next request.
                replay.close(linger=0)
                replay = None
        for seq in range(start, end):
            payload = got.get(seq)
            if payload is None:
                self.missed += 1
                continue
            self.replayed += 1
            self._deliver(payload)
        if end - start > len(got):
            log.warning("missed %d KV event batches from vLLM (seq %d..%d); its blocks are forgotten",
                        end - start - len(got), start, end - 1)
            self._cleared()
        return replay

    def _cleared(self) -> None:
        self.rehasher.clear()
        self._publish(KVEventBatch(ts=self._clock.time(), events=[AllBlocksCleared()]))

    def _deliver(self, payload: bytes) -> None:
        try:
            batch = decode_vllm_batch(payload)
        except KVEventDecodeError as exc:
            self.decode_errors += 1
            log.warning("ignoring an undecodable KV event batch: %s", exc)
            return
        self.batches += 1
        self._publish(self.rehasher.translate(batch))

    def _publish(self, batch: KVEventBatch) -> None:
        sink = self._sink
        if sink is None:
            return
        try:
            sink.publish(batch)
        except Exception:
            log.exception("the KV event sink failed")
