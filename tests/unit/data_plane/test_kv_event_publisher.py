"""The node's KV event stream, as a consumer written for vLLM sees it.

The subscriber side decodes with structs copied from vLLM's published schema
(`vllm/distributed/kv_events.py`, the positional encoding of vLLM <= 0.23 with
`lora_name`), defined here on purpose instead of imported from meridian.kv_events: if
our wire structs drift from vLLM's, these tests fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from vllm_kv_schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from data_plane.engine.base import EngineStats, KVEventSink
from data_plane.kv_events import DropOldestQueue, ZmqEventPublisher, create_publisher
from data_plane.runtime import NodeRuntime
from meridian import kv_events as ours
from meridian.ports import free_port
from meridian.settings.node import NodeSettings

VLLM_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
VLLM_END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Bounds the waits below; reaching one is a failure, never a measurement.
DEADLINE_S = 10.0


# --- helpers -----------------------------------------------------------------------------


def stored(hashes: list[int], parent: int | None = None, lora: str | None = None) -> ours.BlockStored:
    return ours.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(4 * len(hashes))),
        block_size=4, lora_id=None, medium=ours.MEDIUM_GPU, lora_name=lora,
    )


def removed(hashes: list[int]) -> ours.BlockRemoved:
    return ours.BlockRemoved(block_hashes=hashes, medium=ours.MEDIUM_GPU)


def batch(*events: ours.KVEvent, ts: float = 1.0) -> ours.KVEventBatch:
    return ours.KVEventBatch(ts=ts, events=list(events))


def as_builtins(b: KVEventBatch | ours.KVEventBatch) -> Any:
    """A batch as plain data with event tags, comparable across the two struct families."""
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in b.events]
    return {"ts": b.ts, "events": events, "data_parallel_rank": b.data_parallel_rank}


def seq_of(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscriber(ctx: zmq.Context[Any], endpoint: str, topics: list[str], *, bind: bool = False) -> zmq.Socket[Any]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    # Unbounded: the tests read after publishing, and a full SUB queue drops silently.
    sub.setsockopt(zmq.RCVHWM, 0)
    for topic in topics:
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    if bind:
        sub.bind(endpoint)
    else:
        sub.connect(endpoint)
    return sub


def recv(sub: zmq.Socket[Any]) -> tuple[bytes, int, KVEventBatch]:
    if not sub.poll(DEADLINE_S * 1000):
        raise AssertionError("no KV event batch arrived")
    topic, seq, payload = sub.recv_multipart()
    return topic, seq_of(seq), VLLM_DECODER.decode(payload)


def sync(pub: ZmqEventPublisher, sub: zmq.Socket[Any]) -> int:
    """Publish empty batches until `sub` gets one (PUB/SUB slow joiner), drain what
    arrived, and return how many were published: the next batch's sequence number."""
    deadline = time.monotonic() + DEADLINE_S
    probes = 0
    while time.monotonic() < deadline:
        pub.publish(batch(ts=0.0))
        probes += 1
        if sub.poll(20):
            break
    else:
        raise AssertionError("subscription never became effective")
    last = -1
    while last != probes - 1:
        _, last, probe = recv(sub)
        assert probe.events == []
    return probes


def wait_sent(pub: ZmqEventPublisher, count: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while pub.sent < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {pub.sent} of {count} batches were sent")
        time.sleep(0.005)


def replay(
    ctx: zmq.Context[Any], endpoint: str, start: int, *, junk_first: bytes | None = None
) -> list[tuple[int, KVEventBatch]]:
    """Ask the replay socket for batches from `start`, as vLLM's consumers do
    (after a malformed request `junk_first`, when given)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        if junk_first is not None:
            dealer.send_multipart([b"", junk_first])
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, KVEventBatch]] = []
        while True:
            if not dealer.poll(DEADLINE_S * 1000):
                raise AssertionError("replay never ended")
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == VLLM_END_SEQ:
                assert payload == b""
                return out
            out.append((seq_of(seq), VLLM_DECODER.decode(payload)))
    finally:
        dealer.close()


@pytest.fixture
def publishers() -> Iterator[list[ZmqEventPublisher]]:
    created: list[ZmqEventPublisher] = []
    yield created
    for pub in created:
        pub.close()


# --- the stream ---------------------------------------------------------------------------


def test_vllm_subscriber_decodes_every_event_kind(
    ctx: zmq.Context[Any], publishers: list[ZmqEventPublisher]
) -> None:
    port = free_port()
    pub = ZmqEventPublisher(f"tcp://*:{port}", topic="kv@node-a@tiny-llama")
    publishers.append(pub)
    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}", ["kv@node-a@tiny-llama"])
    first = sync(pub, sub)

    sent = [
        batch(stored([2**64 - 1, 7], parent=None), ts=10.5),
        batch(stored([8], parent=7, lora="sql-adapter"), removed([7]), ts=11.0),
        batch(ours.AllBlocksCleared(), ts=12.25),
        ours.KVEventBatch(ts=13.0, events=[removed([1])], data_parallel_rank=3),
    ]
    for b in sent:
        pub.publish(b)

    for i, expected in enumerate(sent):
        topic, seq, got = recv(sub)
        assert topic == b"kv@node-a@tiny-llama"
        assert seq == first + i
        want = as_builtins(expected)
        # Like vLLM's publisher: a batch without a rank is stamped with the publisher's (0).
        if want["data_parallel_rank"] is None:
            want["data_parallel_rank"] = 0
        assert as_builtins(got) == want
    assert pub.dropped == 0


def test_replay_serves_missed_batches_then_end_marker(
    ctx: zmq.Context[Any], publishers: list[ZmqEventPublisher]
) -> None:
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(
        f"tcp://*:{free_port()}", replay_endpoint=replay_endpoint, topic="kv", buffer_steps=6
    )
    publishers.append(pub)
    # Nobody listens live: everything below is only recoverable through replay.
    for i in range(10):
        pub.publish(batch(stored([100 + i]), ts=float(i)))
    wait_sent(pub, 10)

    got = replay(ctx, replay_endpoint, 6)
    assert [seq for seq, _ in got] == [6, 7, 8, 9]
    assert [b.events[0].block_hashes for _, b in got] == [[106], [107], [108], [109]]
    # The ring keeps the last 6 batches; older requests get what is left.
    assert [seq for seq, _ in replay(ctx, replay_endpoint, 0)] == [4, 5, 6, 7, 8, 9]
    assert replay(ctx, replay_endpoint, 10) == []


def test_replay_numbers_batches_from_zero_and_ignores_malformed_requests(
    ctx: zmq.Context[Any], publishers: list[ZmqEventPublisher]
) -> None:
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(f"tcp://*:{free_port()}", replay_endpoint=replay_endpoint)
    publishers.append(pub)
    for i in range(3):
        pub.publish(batch(removed([i])))
    wait_sent(pub, 3)

    # The malformed request gets no answer; the next one on the same connection does.
    got = replay(ctx, replay_endpoint, 0, junk_first=b"not-a-seq")
    assert [(seq, b.events[0].block_hashes) for seq, b in got] == [(0, [0]), (1, [1]), (2, [2])]


def test_concurrent_publishers_lose_nothing_and_keep_each_threads_order(
    ctx: zmq.Context[Any], publishers: list[ZmqEventPublisher]
) -> None:
    port = free_port()
    pub = ZmqEventPublisher(f"tcp://*:{port}", topic="kv")
    publishers.append(pub)
    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}", ["kv"])
    first = sync(pub, sub)

    threads, per_thread = 8, 250
    start = threading.Barrier(threads)

    def engine_thread(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            pub.publish(batch(stored([t * 1_000_000 + i])))

    workers = [threading.Thread(target=engine_thread, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    seqs: list[int] = []
    seen: dict[int, list[int]] = {t: [] for t in range(threads)}
    for _ in range(threads * per_thread):
        _, seq, got = recv(sub)
        seqs.append(seq)
        (h,) = got.events[0].block_hashes
        assert isinstance(h, int)
        seen[h // 1_000_000].append(h % 1_000_000)
    assert seqs == list(range(first, first + threads * per_thread))
    assert all(order == list(range(per_thread)) for order in seen.values())
    assert pub.dropped == 0


def test_close_flushes_the_queue_and_frees_the_endpoint(
    ctx: zmq.Context[Any], publishers: list[ZmqEventPublisher]
) -> None:
    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(
        f"tcp://*:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv"
    )
    publishers.append(pub)
    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}", ["kv"])
    first = sync(pub, sub)
    for i in range(500):
        pub.publish(batch(stored([i])))
    pub.close()

    assert [recv(sub)[1] for _ in range(500)] == list(range(first, first + 500))
    # Published after close: discarded and counted, never raised into the engine.
    pub.publish(batch(stored([1])))
    assert pub.dropped == 1
    pub.close()
    # A restarted node binds the same endpoints at once.
    publishers.append(
        ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    )


def test_full_queue_drops_the_oldest_batches() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(3)
    results = [q.put(i) for i in range(5)]
    assert results == [(True, False), (False, False), (False, False), (False, True), (False, True)]
    assert q.take_all() == [2, 3, 4]
    assert q.put(5) == (True, False)


def test_create_publisher_follows_node_settings(ctx: zmq.Context[Any]) -> None:
    assert create_publisher(NodeSettings(kv_events_endpoint=None)) is None
    port = free_port()
    settings = NodeSettings(
        kv_events_endpoint=f"tcp://*:{port}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        kv_events_topic="kv@pod-1@tiny-llama",
    )
    pub = create_publisher(settings)
    assert pub is not None
    try:
        sub = subscriber(ctx, f"tcp://127.0.0.1:{port}", ["kv@pod-1@tiny-llama"])
        sync(pub, sub)
        assert pub.replay_endpoint == settings.kv_events_replay_endpoint
        assert replay(ctx, pub.replay_endpoint, 0)
    finally:
        pub.close()


# --- a KV-aware router's block index -------------------------------------------------------


class BlockIndex:
    """Which block hashes each node holds, rebuilt from the nodes' KV event streams the
    way a vLLM consumer (llm-d's indexer, a KV-aware router) does: one SUB socket that
    the nodes connect to, one topic per node, gaps in sequence numbers filled by replay."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, replay_endpoints: dict[str, str]) -> None:
        self._ctx = ctx
        self._replay_endpoints = replay_endpoints
        self._sub = subscriber(ctx, endpoint, list(replay_endpoints), bind=True)
        self.blocks: dict[str, set[bytes | int]] = {topic: set() for topic in replay_endpoints}
        self.next_seq: dict[str, int] = dict.fromkeys(replay_endpoints, 0)

    def close(self) -> None:
        self._sub.close()

    def poll(self, timeout_ms: int) -> bool:
        """Apply the next live batch, if one arrives in time."""
        if not self._sub.poll(timeout_ms):
            return False
        raw_topic, raw_seq, payload = self._sub.recv_multipart()
        topic, seq = raw_topic.decode(), seq_of(raw_seq)
        if seq > self.next_seq[topic]:
            for missed_seq, missed in replay(self._ctx, self._replay_endpoints[topic], self.next_seq[topic]):
                self._apply(topic, missed_seq, missed)
        self._apply(topic, seq, VLLM_DECODER.decode(payload))
        return True

    def _apply(self, topic: str, seq: int, b: KVEventBatch) -> None:
        if seq < self.next_seq[topic]:
            return  # already applied (a replay overlapping the live stream)
        assert seq == self.next_seq[topic], f"{topic}: gap before {seq} that replay could not fill"
        blocks = self.blocks[topic]
        for event in b.events:
            if isinstance(event, BlockStored):
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
        self.next_seq[topic] = seq + 1

    def catch_up(self, topic: str, sent: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while self.next_seq[topic] < sent:
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic}: applied {self.next_seq[topic]} of {sent} batches")
            self.poll(50)


def test_block_index_reconstructs_what_each_node_holds(
    ctx: zmq.Context[Any], publishers: list[ZmqEventPublisher]
) -> None:
    collector = f"tcp://127.0.0.1:{free_port()}"
    replays = {"kv@node-a@tiny": f"tcp://127.0.0.1:{free_port()}",
               "kv@node-b@tiny": f"tcp://127.0.0.1:{free_port()}"}
    index = BlockIndex(ctx, collector, replays)
    try:
        # Nodes connect to the collector (vLLM's "host:port" endpoint mode).
        node_a, node_b = (
            ZmqEventPublisher(collector, replay_endpoint=replays[topic], topic=topic) for topic in replays
        )
        publishers.extend([node_a, node_b])
        published = {"kv@node-a@tiny": 0, "kv@node-b@tiny": 0}

        def publish(node: ZmqEventPublisher, topic: str, b: ours.KVEventBatch) -> None:
            node.publish(b)
            published[topic] += 1

        # Empty batches until each node's connection carries events; the index starts
        # from seq 0 regardless, replaying what was published before that.
        for node, topic in ((node_a, "kv@node-a@tiny"), (node_b, "kv@node-b@tiny")):
            deadline = time.monotonic() + DEADLINE_S
            while index.next_seq[topic] == 0:
                assert time.monotonic() < deadline, "node never reached the collector"
                publish(node, topic, batch())
                index.poll(20)

        publish(node_a, "kv@node-a@tiny", batch(stored([1, 2, 3])))
        publish(node_b, "kv@node-b@tiny", batch(stored([10, 11], lora="sql")))
        publish(node_a, "kv@node-a@tiny", batch(stored([4], parent=3), removed([2])))
        publish(node_b, "kv@node-b@tiny", batch(ours.AllBlocksCleared()))
        publish(node_b, "kv@node-b@tiny",
                batch(stored([12], lora="sql"), stored([13], parent=12, lora="sql")))
        publish(node_a, "kv@node-a@tiny", batch(removed([4])))
        publish(node_b, "kv@node-b@tiny", batch(removed([13, 999])))

        for topic, count in published.items():
            index.catch_up(topic, count)
        assert index.blocks == {"kv@node-a@tiny": {1, 3}, "kv@node-b@tiny": {12}}
    finally:
        index.close()


# --- wiring into the node ------------------------------------------------------------------


class EventfulEngine:
    """Just enough of an engine for NodeRuntime: records its lifecycle and publishes a
    batch from its own thread when it stops, as a real engine's last step would."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.sink: KVEventSink | None = None

    def set_kv_event_sink(self, sink: KVEventSink | None) -> None:
        self.calls.append("set_kv_event_sink")
        self.sink = sink

    async def start(self) -> None:
        self.calls.append("start")

    async def stop(self) -> None:
        self.calls.append("stop")
        sink = self.sink
        assert sink is not None
        step = threading.Thread(target=sink.publish, args=(batch(removed([42])),))
        step.start()
        step.join()

    def models(self) -> list[str]:
        return ["tiny-llama"]

    def stats(self) -> EngineStats:
        return EngineStats()


async def test_node_publishes_its_engines_events_until_the_engine_stops(ctx: zmq.Context[Any]) -> None:
    port = free_port()
    settings = NodeSettings(
        control_plane_url=None, kv_events_endpoint=f"tcp://*:{port}", kv_events_topic="kv@node@tiny"
    )
    engine = EventfulEngine()
    runtime = NodeRuntime(settings, engine)  # type: ignore[arg-type]
    await runtime.start()
    await runtime.wait_ready()
    assert engine.calls == ["set_kv_event_sink", "start"]
    assert isinstance(engine.sink, ZmqEventPublisher) and engine.sink is runtime.kv_events

    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}", ["kv@node@tiny"])
    first = sync(runtime.kv_events, sub)
    await runtime.shutdown()

    assert engine.calls[-1] == "stop" and runtime.kv_events is None
    topic, seq, last = recv(sub)
    assert (topic, seq, last.events) == (b"kv@node@tiny", first, [BlockRemoved(block_hashes=[42], medium="GPU")])
    # Closed with the node: the endpoint is free for the next one.
    ZmqEventPublisher(f"tcp://*:{port}").close()
