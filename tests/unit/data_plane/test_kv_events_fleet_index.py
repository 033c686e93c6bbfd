"""A consumer written for vLLM's KV events reconstructs, from our nodes' event streams
alone, exactly which blocks each node's prefix cache holds.

The consumer below knows nothing of Meridian: it decodes with vLLM's published
structs (copied here, as vLLM's own example subscriber does), subscribes to each
node's ZMQ PUB socket, catches up through the replay socket, and applies BlockStored /
BlockRemoved / AllBlocksCleared to a per-node set of block hashes.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from node_testkit import eventually, make_settings
from vllm_kv_schema import BlockRemoved, BlockStored, KVEventBatch

from data_plane.engine.base import GenerationRequest, SamplingParams
from data_plane.engine.torch_engine import TorchEngine
from data_plane.kv_events import ZmqEventPublisher
from meridian.ports import free_port


class FleetBlockIndex:
    """Which block hashes each node holds, from its events (what a KV-aware router keeps)."""

    def __init__(self, ctx: zmq.Context[Any], nodes: dict[str, tuple[str, str]]) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.blocks: dict[str, set[bytes | int]] = {name: set() for name in nodes}
        self.last_seq: dict[str, int] = {name: -1 for name in nodes}
        self.removed: dict[str, int] = {name: 0 for name in nodes}
        self.live = 0
        self.sub = ctx.socket(zmq.SUB)
        self.replay: dict[str, zmq.Socket[Any]] = {}
        for name, (endpoint, replay) in nodes.items():
            self.sub.connect(endpoint)
            self.sub.setsockopt(zmq.SUBSCRIBE, f"kv@{name}".encode())
            # DEALER, not REQ: a REQ socket keeps only the first of the replay's many replies.
            req = ctx.socket(zmq.DEALER)
            req.connect(replay)
            self.replay[name] = req

    def catch_up(self, node: str) -> None:
        """Ask the node's replay socket for everything after the last batch seen."""
        req = self.replay[node]
        req.send_multipart([b"", (self.last_seq[node] + 1).to_bytes(8, "big")])
        while req.poll(2000):
            _, seq_bytes, payload = req.recv_multipart()
            if not payload:
                return
            self.apply(node, int.from_bytes(seq_bytes, "big", signed=True), payload)
        raise AssertionError(f"no end-of-replay from {node}")

    def poll(self) -> None:
        while self.sub.poll(0):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            node = topic.decode().removeprefix("kv@")
            seq = int.from_bytes(seq_bytes, "big")
            self.live += 1
            if seq > self.last_seq[node] + 1:
                self.catch_up(node)
            self.apply(node, seq, payload)

    def apply(self, node: str, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq[node]:
            return
        self.last_seq[node] = seq
        for event in self.decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                self.blocks[node].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks[node].difference_update(event.block_hashes)
                self.removed[node] += len(event.block_hashes)
            else:
                self.blocks[node].clear()


@pytest.fixture
def zmq_ctx() -> Any:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_vllm_consumer_reconstructs_each_nodes_blocks(tiny_checkpoint: Path, zmq_ctx: Any) -> None:
    nodes = {}
    engines: dict[str, TorchEngine] = {}
    publishers = []
    # node-b's cache is small, so its workload evicts blocks (BlockRemoved) as it goes.
    for name, memory in (("node-a", 4 * 1024 * 1024), ("node-b", 64 * 1024)):
        # A '*' makes the publisher bind (vLLM's rule); it reports the port it got.
        replay = f"tcp://127.0.0.1:{free_port()}"
        pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint=replay, topic=f"kv@{name}")
        publishers.append(pub)
        endpoint = pub.endpoint
        engine = TorchEngine(make_settings(tiny_checkpoint, block_size=4, kv_cache_memory_bytes=memory,
                                           max_num_seqs=8))
        engine.set_kv_event_sink(pub)
        engines[name] = engine
        nodes[name] = (endpoint, replay)
    index = FleetBlockIndex(zmq_ctx, nodes)
    try:
        for engine in engines.values():
            await engine.start()
        rng = random.Random(3)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

        async def serve(name: str, n: int) -> None:
            engine = engines[name]
            shared = [rng.randrange(1, 1000) for _ in range(24)]
            prompts = [shared + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
                       for _ in range(n)]
            await asyncio.gather(*(
                _drain(engine, GenerationRequest(f"{name}-{i}", p, params)) for i, p in enumerate(prompts)
            ))

        await asyncio.gather(serve("node-a", 12), serve("node-b", 40))

        # Whatever was published before the subscription took effect comes from replay.
        for name in nodes:
            index.catch_up(name)
        live_before = index.live

        def synced() -> bool:
            index.poll()
            return all(index.blocks[n] == engines[n]._kv.pool.cached_hashes() for n in nodes)  # type: ignore[union-attr]

        await eventually(synced)
        assert index.blocks["node-a"] and index.blocks["node-b"]
        assert not index.blocks["node-a"] & index.blocks["node-b"]
        # node-b evicted blocks and the consumer followed; node-a never had to.
        assert index.removed["node-b"] > 0 and index.removed["node-a"] == 0
        # Once subscribed, new work reaches the consumer live, not only through replay.
        await serve("node-a", 3)
        await eventually(synced)
        assert index.live > live_before
    finally:
        for engine in engines.values():
            await engine.stop()
        for pub in publishers:
            pub.close()


async def _drain(engine: TorchEngine, request: GenerationRequest) -> None:
    async for _ in engine.generate(request):
        pass
