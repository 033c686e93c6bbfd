"""How long one `apply` holds the KV index's lock at a big node whose cache evicts out of
store order (vLLM evicts by last use), against a previous revision of geo_router/state/kv_index.py
in the same run: the longest and the 99th-percentile hold, in ms.

    python -m bench.kv_index_hold [--blocks 150000] [--batches 600] [--baseline-rev REV]

One node holds --blocks blocks; each batch removes 250 random ones, stores 250 new and
stores again 100 held ones (used again), so stale copies pile up in the middle of the
node's store order. `match` waits on that lock on the router's request path.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.kv_index import load_baseline
from geo_router.state.kv_index import KVIndex
from meridian.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent


def _stored(hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=MEDIUM_GPU, lora_name=None)


def holds(index: Any, blocks: int, batches: int, seed: int = 1) -> tuple[list[float], list[float]]:
    """Seconds each churn batch's `apply` took: wall clock, and this thread's CPU time (on a
    shared box the wall clock also counts the time the thread was descheduled)."""
    rng = random.Random(seed)
    live = [rng.getrandbits(63) for _ in range(blocks)]
    for i in range(0, blocks, 4096):
        index.apply("a", [_stored(live[i:i + 4096])])
    wall, cpu = [], []
    for _ in range(batches):
        gone = [live.pop(rng.randrange(len(live))) for _ in range(250)]  # O(n) pops: outside the timing
        new = [rng.getrandbits(63) for _ in range(250)]
        events: list[KVEvent] = [BlockRemoved(block_hashes=gone, medium=MEDIUM_GPU), _stored(new),
                                 _stored(rng.sample(live, 100))]
        live.extend(new)
        t0, c0 = time.perf_counter(), time.thread_time()
        index.apply("a", events)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=150_000)
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument("--baseline-rev", default="c7a7d46")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline_rev)
    for name, factory in ((f"baseline {args.baseline_rev}", baseline.KVIndex), ("current", KVIndex)):
        for clock, took in zip(("wall", "cpu"), holds(factory(), args.blocks, args.batches), strict=True):
            took.sort()
            print(f"{name:>18}: apply() lock hold ({clock}) over {len(took)} batches at {args.blocks} blocks: "
                  f"max {took[-1] * 1e3:.2f} ms, p99 {took[int(len(took) * 0.99)] * 1e3:.2f} ms, "
                  f"median {statistics.median(took) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
