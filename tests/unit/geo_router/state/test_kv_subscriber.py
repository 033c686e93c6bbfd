"""The router's KV event subscriber against real node publishers on loopback ports."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
import zmq
import zmq.asyncio
from router_harness import MODEL, REGIONS, eventually, make_table, router_settings

from data_plane.kv_events.publisher import ZmqEventPublisher
from geo_router.state.kv_index import KVIndex
from geo_router.state.kv_subscriber import KVEventSubscriber
from geo_router.state.table import StaticTableSource
from meridian.block_hash import hash_blocks
from meridian.contracts import NodeStatus, RoutingNode, RoutingTableDelta
from meridian.kv_events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    seq_to_bytes,
)
from meridian.ports import free_port

TOPIC = "kv-events"
BLOCK = 4
SYSTEM = list(range(100, 116))
ALICE = hash_blocks([*SYSTEM, *range(200, 212)], BLOCK)  # 7 blocks, the first 4 shared with BOB
BOB = hash_blocks([*SYSTEM, *range(300, 312)], BLOCK)
_probes = itertools.count(1)


def stored(hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * BLOCK * len(hashes),
                       block_size=BLOCK, lora_id=None, medium=MEDIUM_GPU, lora_name=None)


def removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=MEDIUM_GPU)


def batch(*events: KVEvent) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


@dataclass
class Node:
    """A node's real KV event publisher, and the endpoints it would advertise."""

    node_id: str
    port: int = field(default_factory=free_port)
    replay_port: int | None = field(default_factory=free_port)
    publisher: ZmqEventPublisher | None = None

    def start(self) -> Node:
        replay = f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None
        self.publisher = ZmqEventPublisher(f"tcp://*:{self.port}", replay_endpoint=replay, topic=TOPIC)
        return self

    async def close(self) -> None:
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)
            self.publisher = None

    def publish(self, *events: KVEvent) -> None:
        assert self.publisher is not None
        self.publisher.publish(batch(*events))

    async def sent(self, count: int) -> None:
        """Wait until `count` batches left the publisher (and sit in its replay buffer)."""
        await eventually(lambda: self.publisher is not None and self.publisher.sent == count)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    def routing_node(self, *, endpoint: str | None = None) -> RoutingNode:
        return RoutingNode(node_id=self.node_id, region=REGIONS["us"].name, url="http://127.0.0.1:9",
                           models=[MODEL], status=NodeStatus.READY, kv_events=endpoint or self.endpoint,
                           kv_events_replay=self.replay_endpoint)


class Nodes:
    """The nodes a test started; their publishers are closed when it ends."""

    def __init__(self) -> None:
        self._made: list[Node] = []

    def start(self, node_id: str, *, replay: bool = True) -> Node:
        return self._start(Node(node_id) if replay else Node(node_id, replay_port=None))

    async def restart(self, node: Node) -> Node:
        """`node`'s publisher stopped and a new one on the same ports: a stream counting from 0."""
        await node.close()
        return self._start(Node(node.node_id, port=node.port, replay_port=node.replay_port))

    def _start(self, node: Node) -> Node:
        self._made.append(node.start())
        return node

    def close_all(self) -> None:
        for node in self._made:
            if node.publisher is not None:
                node.publisher.close()


class LossyLink:
    """Forwards a publisher's stream to the router, dropping the batches it is told to, as
    a congested network (or a full ZMQ pipe) would. Replays still reach the publisher."""

    def __init__(self, source: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = free_port()
        self._pub.bind(f"tcp://*:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.to_drop = 0
        self.dropped: list[int] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if self.to_drop:
                self.to_drop -= 1
                self.dropped.append(int.from_bytes(frames[1], "big"))
                continue
            await self._pub.send_multipart(frames)

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task
        self._sub.close()
        self._pub.close()
        self._ctx.term()


Links = Callable[[Node], LossyLink]


@dataclass
class Router:
    """The router side: a table source, the index and the subscriber following the table."""

    source: StaticTableSource
    index: KVIndex
    subscriber: KVEventSubscriber

    def set_nodes(self, *nodes: RoutingNode) -> None:
        current = self.source.current()
        self.source.set(make_table(list(nodes), version=current.version + 1 if current else 1))

    def held(self, node_id: str, hashes: list[int]) -> int:
        return self.index.match(hashes, [node_id])[node_id]


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    index = KVIndex()
    source = StaticTableSource()
    subscriber = KVEventSubscriber(router_settings(kv_events_replay_timeout_s=1.0), index)
    source.add_listener(subscriber.on_table)
    await subscriber.start()
    try:
        yield Router(source, index, subscriber)
    finally:
        started = time.monotonic()
        await subscriber.stop()
        assert time.monotonic() - started < 2.0, "stop() must be prompt"


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    made = Nodes()
    yield made
    made.close_all()


@pytest.fixture
async def links() -> AsyncIterator[Links]:
    """Lossy links in front of nodes' publishers, closed when the test ends."""
    made: list[LossyLink] = []

    def link(node: Node) -> LossyLink:
        made.append(LossyLink(node.endpoint))
        return made[-1]

    yield link
    for each in made:
        await each.close()


async def until_live(router: Router, node_id: str, publish: object) -> None:
    """Publish probe blocks until one reaches the index, so nothing published afterwards is
    lost to ZMQ's slow joiner (a SUB misses what is sent before it is connected)."""
    assert callable(publish)
    probe = [10**15 + next(_probes)]
    for _ in range(300):
        publish(stored(probe))
        try:
            await eventually(lambda: router.held(node_id, probe) == 1, timeout_s=0.05)
            break
        except AssertionError:
            continue
    else:
        raise AssertionError(f"no event from {node_id} reached the index")
    publish(removed(probe))
    await eventually(lambda: router.held(node_id, probe) == 0)


async def test_events_reach_the_index_including_those_sent_before_subscribing(
    router: Router, nodes: Nodes
) -> None:
    node = nodes.start("us-1")
    # Published before the router subscribes: recovered from the replay buffer on connect.
    node.publish(stored(ALICE))
    await node.sent(1)
    router.set_nodes(node.routing_node())
    await eventually(lambda: router.held("us-1", ALICE) == 7)
    assert router.subscriber.subscribed_nodes() == frozenset({"us-1"})

    node.publish(removed(ALICE[5:]), stored(BOB[4:]))
    await eventually(lambda: router.held("us-1", ALICE) == 5 and router.held("us-1", BOB) == 7)
    assert router.index.block_size("us-1") == BLOCK
    stats = router.subscriber.stats
    assert stats.batches >= 2 and stats.events >= 3
    assert (stats.lost_batches, stats.decode_errors) == (0, 0)


async def test_a_gap_is_filled_from_the_replay_socket(router: Router, nodes: Nodes, links: Links) -> None:
    node = nodes.start("us-1")
    link = links(node)
    router.set_nodes(node.routing_node(endpoint=link.endpoint))
    await until_live(router, "us-1", node.publish)

    link.to_drop = 2
    node.publish(stored(ALICE))
    node.publish(removed(ALICE[5:]))  # lost on the way: must still be applied
    node.publish(stored(BOB[4:]))
    await eventually(lambda: router.held("us-1", BOB) == 7)
    assert len(link.dropped) == 2
    assert router.held("us-1", ALICE) == 5
    stats = router.subscriber.stats
    assert stats.gaps == 1 and stats.replayed_batches >= 2
    assert stats.lost_batches == 0


async def test_without_replay_a_gap_clears_the_node(router: Router, nodes: Nodes, links: Links) -> None:
    node = nodes.start("us-1", replay=False)
    other = nodes.start("eu-1", replay=False)
    link = links(node)
    router.set_nodes(node.routing_node(endpoint=link.endpoint), other.routing_node())
    await until_live(router, "us-1", node.publish)
    await until_live(router, "eu-1", other.publish)
    node.publish(stored(ALICE))
    other.publish(stored(ALICE))
    await eventually(lambda: router.held("us-1", ALICE) == 7 and router.held("eu-1", ALICE) == 7)

    link.to_drop = 1
    node.publish(removed(ALICE[3:]))  # lost: the router can no longer trust us-1's entries
    node.publish(stored(BOB))
    await eventually(lambda: router.held("us-1", BOB) == 7)
    # Nothing of what came before the gap survives, not even the blocks it did not remove...
    assert router.index.node_blocks("us-1") == len(BOB)
    assert router.held("us-1", ALICE) == 4  # (these four are BOB's too)
    # ...and the other node is untouched.
    assert router.held("eu-1", ALICE) == 7
    assert router.subscriber.stats.lost_batches == 1


async def test_table_changes_connect_disconnect_and_forget_nodes(router: Router, nodes: Nodes) -> None:
    a, b = nodes.start("us-1"), nodes.start("eu-1")
    router.set_nodes(a.routing_node(), b.routing_node())
    await until_live(router, "us-1", a.publish)
    await until_live(router, "eu-1", b.publish)
    a.publish(stored(ALICE))
    b.publish(stored(BOB))
    await eventually(lambda: router.held("us-1", ALICE) == 7 and router.held("eu-1", BOB) == 7)

    # eu-1 leaves the table: its entries go, and what it publishes afterwards is not applied.
    router.set_nodes(a.routing_node())
    await eventually(lambda: "eu-1" not in router.index.nodes())
    assert router.subscriber.subscribed_nodes() == frozenset({"us-1"})
    b.publish(stored(ALICE))
    a.publish(stored(BOB))
    await eventually(lambda: router.held("us-1", BOB) == 7)
    assert router.held("eu-1", ALICE) == 0

    # us-1 moves to another publisher (a new endpoint): its old entries are not carried over.
    await a.close()
    moved = nodes.start("us-1")
    moved.publish(stored(BOB[:2]))
    await moved.sent(1)
    router.set_nodes(moved.routing_node())
    await eventually(lambda: router.held("us-1", BOB) == 2)
    assert router.held("us-1", ALICE) == 2

    # A table without KV events (an unrelated change) drops the subscriptions.
    router.set_nodes(RoutingNode(node_id="us-1", region=REGIONS["us"].name, url="http://127.0.0.1:9",
                                 models=[MODEL], status=NodeStatus.READY))
    await eventually(lambda: router.index.nodes() == [])
    assert router.subscriber.subscribed_nodes() == frozenset()


async def test_a_delta_connects_changed_nodes_and_forgets_removed_ones(router: Router, nodes: Nodes) -> None:
    a, b, c = nodes.start("us-1"), nodes.start("eu-1"), nodes.start("eu-2")
    router.set_nodes(a.routing_node(), b.routing_node())
    await until_live(router, "us-1", a.publish)
    await until_live(router, "eu-1", b.publish)
    a.publish(stored(ALICE))
    b.publish(stored(BOB))
    await eventually(lambda: router.held("us-1", ALICE) == 7 and router.held("eu-1", BOB) == 7)

    # One delta: us-1 moves to another publisher, eu-1 leaves, eu-2 joins.
    await a.close()
    moved = nodes.start("us-1")
    moved.publish(stored(BOB[:2]))
    await moved.sent(1)
    router.source.apply_delta(RoutingTableDelta(
        base_version=1, base_build="b1", version=2, build="b2", generated_at=datetime.now(UTC),
        nodes_upserted=[moved.routing_node(), c.routing_node()], nodes_removed=["eu-1"],
    ))
    assert router.source.current().changed_nodes == {"us-1", "eu-1", "eu-2"}
    await eventually(lambda: router.subscriber.subscribed_nodes() == frozenset({"us-1", "eu-2"}))
    await eventually(lambda: "eu-1" not in router.index.nodes())
    await eventually(lambda: router.held("us-1", BOB) == 2)  # the new endpoint's replay
    assert router.held("us-1", ALICE) == 2  # the old endpoint's 7 blocks were not carried over
    await until_live(router, "eu-2", c.publish)
    c.publish(stored(ALICE))
    await eventually(lambda: router.held("eu-2", ALICE) == 7)

    # A delta that changes nothing KV events care about leaves the subscriptions alone.
    router.source.apply_delta(RoutingTableDelta(
        base_version=2, base_build="b2", version=3, build="b3", generated_at=datetime.now(UTC),
        nodes_upserted=[c.routing_node().model_copy(update={"url": "http://127.0.0.1:9"})],
    ))
    assert router.subscriber.subscribed_nodes() == frozenset({"us-1", "eu-2"})
    assert router.held("eu-2", ALICE) == 7


async def test_a_restarted_publisher_resets_the_node(router: Router, nodes: Nodes) -> None:
    node = nodes.start("us-1")
    router.set_nodes(node.routing_node())
    await until_live(router, "us-1", node.publish)
    for i in range(5):  # its sequence runs ahead of the next process's
        node.publish(stored(ALICE[: i + 3]))
    await eventually(lambda: router.held("us-1", ALICE) == 7)

    # The node restarts on the same ports: a new publisher counting from 0, an empty cache.
    restarted = await nodes.restart(node)
    # It gets further than the old process did before the router hears from it, so its
    # sequence does not go back: only the dropped connection says this is a new stream.
    for _ in range(100):
        restarted.publish(stored(BOB[:2]))
    await restarted.sent(100)
    await until_live(router, "us-1", restarted.publish)
    await eventually(lambda: router.held("us-1", BOB) == 2)
    assert router.held("us-1", ALICE) == 2  # the blocks it had before the restart are gone
    assert router.index.node_blocks("us-1") == 2
    assert router.subscriber.stats.resets >= 1

    restarted.publish(stored(BOB))
    await eventually(lambda: router.held("us-1", BOB) == 7)


async def test_a_sequence_that_starts_over_behind_a_proxy_resets_the_node(
    router: Router, nodes: Nodes, links: Links
) -> None:
    # Behind a forwarder the router's connection never drops: only the sequence tells.
    node = nodes.start("us-1")
    link = links(node)
    router.set_nodes(node.routing_node(endpoint=link.endpoint))
    await until_live(router, "us-1", node.publish)
    for i in range(5):
        node.publish(stored(ALICE[: i + 3]))
    # The stream well ahead of where the new one will be once the forwarder has reconnected
    # to it: a new stream that overtook it first (probes lost while the forwarder reconnects,
    # under load) would read as a gap, not as starting over. A router cannot tell those apart
    # by sequence numbers alone; the test is of the case it can.
    filler = [10**15 - 1]
    for _ in range(100):
        node.publish(stored(filler))
        node.publish(removed(filler))
    await eventually(lambda: router.held("us-1", ALICE) == 7 and router.held("us-1", filler) == 0
                     and router.subscriber.stats.batches >= 205)
    resets = router.subscriber.stats.resets

    restarted = await nodes.restart(node)
    await until_live(router, "us-1", restarted.publish)
    restarted.publish(stored(BOB[:2]))
    await eventually(lambda: router.held("us-1", BOB) == 2)
    assert router.held("us-1", ALICE) == 2
    assert router.subscriber.stats.resets == resets + 1


async def test_malformed_messages_are_ignored_and_counted(router: Router) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = free_port()
    pub.bind(f"tcp://*:{port}")
    seq = itertools.count()

    def send(*events: KVEvent) -> None:
        pub.send_multipart([TOPIC.encode(), seq_to_bytes(next(seq)), encode_batch(batch(*events))])

    try:
        router.set_nodes(RoutingNode(node_id="us-1", region=REGIONS["us"].name, url="http://127.0.0.1:9",
                                     models=[MODEL], status=NodeStatus.READY, kv_events=f"tcp://127.0.0.1:{port}"))
        await until_live(router, "us-1", send)
        send(stored(ALICE))
        pub.send_multipart([TOPIC.encode(), b"no-seq"])
        pub.send_multipart([TOPIC.encode(), seq_to_bytes(next(seq)), b"\xc1 not msgpack"])
        send(stored(BOB))
        await eventually(lambda: router.held("us-1", BOB) == 7)
        assert router.subscriber.stats.decode_errors == 2
        # The undecodable batch may have removed blocks: what came before it was dropped.
        assert router.held("us-1", ALICE) == 4
    finally:
        pub.close()
        ctx.term()


async def test_a_scoped_router_follows_only_the_nodes_of_regions_near_it(nodes: Nodes) -> None:
    """kv_events_max_rtt_ms: a router in us-east-1 indexes its own region's caches, not
    Europe's (~90 ms away), whether the far node comes in a full table or in a delta."""
    index = KVIndex()
    source = StaticTableSource()
    settings = router_settings(router_location=REGIONS["us"].name, kv_events_max_rtt_ms=40.0)
    subscriber = KVEventSubscriber(settings, index)
    source.add_listener(subscriber.on_table)
    await subscriber.start()
    router = Router(source, index, subscriber)
    try:
        near, far, later = nodes.start("us-1"), nodes.start("eu-1"), nodes.start("eu-2")
        in_eu = {"region": REGIONS["eu"].name}
        router.set_nodes(near.routing_node(), far.routing_node().model_copy(update=in_eu))
        await until_live(router, "us-1", near.publish)
        assert subscriber.scope.regions() == frozenset({REGIONS["us"].name})
        assert subscriber.subscribed_nodes() == frozenset({"us-1"})
        far.publish(stored(ALICE))
        near.publish(stored(BOB))
        await eventually(lambda: router.held("us-1", BOB) == 7)
        assert "eu-1" not in index.nodes()

        # A delta brings a European node: not followed either; a node moving into scope is.
        source.apply_delta(RoutingTableDelta(
            base_version=1, base_build="b1", version=2, build="b2", generated_at=datetime.now(UTC),
            nodes_upserted=[later.routing_node().model_copy(update=in_eu), far.routing_node()],
        ))
        await eventually(lambda: subscriber.subscribed_nodes() == frozenset({"us-1", "eu-1"}))
        assert "eu-2" not in index.nodes()
    finally:
        await subscriber.stop()


def test_a_scope_needs_a_router_location() -> None:
    with pytest.raises(ValueError, match="kv_events_max_rtt_ms needs router_location"):
        router_settings(kv_events_max_rtt_ms=40.0)
