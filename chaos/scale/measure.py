"""In-process micro-measures of what a router pays per table and per request at a fleet size.

These need a table, not a fleet, so they run in the coordinator on the bytes the control
plane actually served:

- `table_install_ms`: what a router pays per table change: parsing a one-node delta (the node
  drained) and `LoadedTable.apply` on the table it holds, as geo_router.state.table installs a
  delta (the fleet's routers also time their installs in flight, see chaos.scale.routers);
- `full_table_install_ms`: `RoutingTable.model_validate_json` + `LoadedTable.build` on the
  bytes of a full table: what a router pays when it starts, or when it is too far behind for
  a delta;
- `select_us`: `geo_router.selection.candidates.select_candidates` over that table for one request (a
  global tenant, one of the fleet's models), in microseconds;
- `kv_index`: a `geo_router.state.kv_index.KVIndex` fed, node by node, with BlockStored batches
  encoded and decoded in the real wire format (meridian.kv_events, as the router's
  subscriber does), `blocks_per_node` blocks each: its memory (tracemalloc) and its ingest
  rate (events per second, measured without tracemalloc). A stated share of every node's
  blocks comes from prefixes common to the nodes of its model (system prompts), the rest
  is its own, since what the index costs depends on how much the nodes share;
- `kv_scope_nodes`: how many nodes the KV index of a router scoped by kv_events_max_rtt_ms
  holds (geo_router.state.kv_scope), for the router placed where that is the most.
"""

from __future__ import annotations

import random
import statistics
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass

from geo_router.selection.candidates import select_candidates
from geo_router.state.health import InProcessFleetState
from geo_router.state.kv_index import KVIndex
from geo_router.state.kv_scope import regions_within
from geo_router.state.table import LoadedTable
from meridian.contracts import (
    GLOBAL_ZONE,
    NodeStatus,
    RoutingNode,
    RoutingTable,
    RoutingTableDelta,
    TenantEntry,
)
from meridian.geo import region_point
from meridian.kv_events import BlockStored, KVEventBatch, decode_batch, encode_batch
from meridian.settings.router import RouterSettings

MIB = 1024 * 1024
BLOCK_SIZE = 16
CHAIN_BLOCKS = 16  # blocks per stored prompt (one BlockStored event)


def grown_table(body: bytes, regions: list[str], models: list[str], nodes: int) -> bytes:
    """The control plane's table `body` with its nodes replaced by `nodes` READY nodes in its
    own format (the simulator's ids, regions and models): the table it would serve at that size."""
    table = RoutingTable.model_validate_json(body)
    template = RoutingNode(node_id="sim-00000", region=regions[0], url="http://127.0.0.1:9", models=[models[0]],
                           status=NodeStatus.READY)
    grown = [template.model_copy(update={
        "node_id": f"sim-{i:05d}", "region": regions[i % len(regions)], "url": f"http://127.0.{i // 256 % 256}.{i % 256}:9",
        "models": [models[(i // len(regions)) % len(models)]]}) for i in range(nodes)]
    return table.model_copy(update={"nodes": grown}).model_dump_json().encode()


def table_install_ms(loaded: LoadedTable, repeat: int = 5) -> float:
    """Median ms to parse a one-node delta (a node drained) and apply it to `loaded`."""
    node = next(n for n in loaded.table.nodes if n.status == NodeStatus.READY)
    build = "b" * 16
    body = RoutingTableDelta(
        base_version=loaded.version, base_build=build, version=loaded.version + 1, build=build,
        generated_at=loaded.table.generated_at,
        nodes_upserted=[node.model_copy(update={"status": NodeStatus.DRAINING})],
    ).model_dump_json().encode()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        loaded.apply(RoutingTableDelta.model_validate_json(body))
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def full_table_install_ms(body: bytes, repeat: int = 5) -> float:
    """Median ms to parse and build a routing table from its JSON bytes."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        LoadedTable.build(RoutingTable.model_validate_json(body))
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def select_us(loaded: LoadedTable, model: str, calls: int = 200) -> float:
    """Median µs of one select_candidates call for `model` over the table (a global tenant),
    bounded at the router's default max_candidates as the router calls it."""
    tenant = TenantEntry(key_hash="0" * 64, key_prefix="sim", tenant="sim", zone=GLOBAL_ZONE)
    fleet = InProcessFleetState(ejection_base_s=30.0, ejection_max_s=300.0)
    limit = RouterSettings.model_fields["max_candidates"].default
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            select_candidates(loaded, tenant, model, fleet, None, limit=limit)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


@dataclass(frozen=True, slots=True)
class KVWorkload:
    """What every node's cache holds: `blocks_per_node` blocks in prompts of CHAIN_BLOCKS, a
    `shared` share of them from `pool` prompts common to the nodes of the node's model."""

    nodes: int
    blocks_per_node: int = 512
    models: int = 4
    shared: float = 0.25
    pool: int = 64
    seed: int = 5

    def describe(self) -> str:
        return (f"{self.blocks_per_node} blocks/node of {BLOCK_SIZE} tokens, {self.shared:.0%} of them"
                f" from {self.pool} prefixes common to the nodes of each of {self.models} models")


@dataclass(frozen=True, slots=True)
class KVFigures:
    index_mib: float
    events_per_s: float
    blocks: int


def kv_scope_nodes(loaded: LoadedTable, max_rtt_ms: float) -> tuple[int, str]:
    """The most nodes a router scoped to `max_rtt_ms` indexes (geo_router.state.kv_scope), over a
    router in each region of the table, and that router's region."""
    per_region = Counter(n.region for n in loaded.table.nodes)
    best = (0, "")
    for name, region in sorted(loaded.regions.items()):
        within = regions_within(region_point(region), loaded.regions, max_rtt_ms)
        best = max(best, (sum(per_region[r] for r in within), name), key=lambda b: b[0])
    return best


def kv_payloads(w: KVWorkload) -> list[tuple[str, bytes]]:
    """Per node, one batch of BlockStored events in the wire format."""
    rng = random.Random(w.seed)
    prompts = w.blocks_per_node // CHAIN_BLOCKS
    shared = round(prompts * w.shared)
    out = []
    for i in range(w.nodes):
        model = i % w.models
        chains = [(model, rng.randrange(w.pool)) for _ in range(shared)]
        chains += [(i, -1 - j) for j in range(prompts - shared)]  # the node's own prompts
        events: list[BlockStored | object] = []
        for a, b in chains:
            base = (a * 1_000_003 + b) * 1_000_033
            hashes = [(base + k) & (2**63 - 1) for k in range(CHAIN_BLOCKS)]
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                      block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None))
        batch = KVEventBatch(ts=0.0, events=events)  # type: ignore[arg-type]
        out.append((f"sim-{i:05d}", encode_batch(batch)))
    return out


def _ingest(index: KVIndex, payloads: list[tuple[str, bytes]]) -> int:
    events = 0
    for node_id, payload in payloads:
        batch = decode_batch(payload)
        index.apply(node_id, batch.events)
        events += len(batch.events)
    return events


def kv_index(w: KVWorkload) -> KVFigures:
    payloads = kv_payloads(w)
    index = KVIndex()
    t0 = time.perf_counter()
    events = _ingest(index, payloads)
    seconds = time.perf_counter() - t0
    blocks = index.stats().blocks
    del index
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = KVIndex()
        _ingest(index, payloads)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return KVFigures(held / MIB, events / seconds if seconds > 0 else 0.0, blocks)
