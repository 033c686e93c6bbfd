"""The router's exact KV-prefix index (geo_router.state.kv_index) against its previous version:
memory per entry, `match` per request and event ingest, in one run.

    python -m bench.kv_index [--nodes 1000 3000] [--baseline-rev REV] [--rounds 5]

The baseline is geo_router/state/kv_index.py as of git revision --baseline-rev (default: the one
before the index kept small holders, whose per-hash node bitmasks grew with nodes x nodes),
loaded from `git show` under another module name, so both run on the same data in the same
process. The index is filled as the fleet simulator measures it (chaos.scale.measure's KV
workload: 512 blocks per node, a quarter from 64 prompts common to the nodes of each of 4
models, the rest the node's own), from the decoded wire batches.

Figures (bench "kv_index", per fleet size): bytes per (node, block) entry under tracemalloc;
ingest events per second (BlockStored of 16 blocks, decoding excluded); `match` µs per
request for a chain against 50 and 1,000 candidate nodes: a miss at the first block, a
16-block system prompt the candidates' model shares (padded to 24 with blocks nobody holds),
that prompt followed by one candidate's own 16-block conversation (a hit of 32 blocks), and
8 blocks of one candidate's own. Each figure is the median over alternated rounds; both
indexes must give the same answers.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.common import Figure
from chaos.scale.measure import CHAIN_BLOCKS, KVWorkload, kv_payloads
from geo_router.state.kv_index import KVIndex
from meridian.kv_events import KVEvent, decode_batch

BENCH = "kv_index"
# main before the index stored one holder as the node and few as a tuple (all bitmasks).
BASELINE_REV = "be04041"
REQUESTS = 200

Batches = list[tuple[str, list[KVEvent]]]


def load_baseline(rev: str) -> ModuleType:
    """geo_router/state/kv_index.py at `rev`, imported as `kv_index_baseline`."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{rev}:geo_router/state/kv_index.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "kv_index_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kv_index_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def batches(payloads: list[tuple[str, bytes]]) -> Batches:
    return [(node_id, decode_batch(payload).events) for node_id, payload in payloads]


def fill(factory: Callable[[], Any], data: Batches) -> tuple[Any, float]:
    """A filled index and the seconds its `apply` calls took."""
    index = factory()
    t0 = time.perf_counter()
    for node_id, events in data:
        index.apply(node_id, events)
    return index, time.perf_counter() - t0


def bytes_per_entry(factory: Callable[[], Any], payloads: list[tuple[str, bytes]]) -> float:
    """Traced bytes per entry, the batches decoded inside the trace (the hashes are the index's)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = factory()
        for node_id, payload in payloads:
            index.apply(node_id, decode_batch(payload).events)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held / index.stats().blocks


def requests(w: KVWorkload, data: Batches, candidates: int, seed: int = 11) -> dict[str, list[tuple[list[int], list[str]]]]:
    """Per case, REQUESTS (chain, candidate node ids) pairs. Node i serves model i % models."""
    rng = random.Random(seed)
    nodes = [node_id for node_id, _ in data]
    own = {node_id: [e.block_hashes for e in events[-4:]] for node_id, events in data}  # unique prompts last
    shared = {i: [e.block_hashes for e in data[i][1][:4]] for i in range(w.models)}  # shared prompts first
    cases: dict[str, list[tuple[list[int], list[str]]]] = {"miss": [], "shared_prefix": [], "prefix_then_own": [],
                                                          "own_only": []}
    for _ in range(REQUESTS):
        model = rng.randrange(w.models)
        of_model = nodes[model::w.models]
        cands = rng.sample(of_model, min(candidates, len(of_model)))
        cands += rng.sample(nodes, candidates - len(cands)) if candidates > len(cands) else []
        target = rng.choice(cands[: len(of_model)])
        system = rng.choice(shared[model])
        nobody = [rng.getrandbits(62) for _ in range(CHAIN_BLOCKS)]
        cases["miss"].append((nobody, cands))
        cases["shared_prefix"].append((system + nobody[:8], cands))
        cases["prefix_then_own"].append((system + rng.choice(own[target]), cands))
        cases["own_only"].append((rng.choice(own[target])[:8], cands))
    return cases


def match_us(index: Any, case: Sequence[tuple[list[int], list[str]]]) -> float:
    t0 = time.perf_counter()
    for chain, cands in case:
        index.match(chain, cands)
    return (time.perf_counter() - t0) / len(case) * 1e6


def run_size(nodes: int, baseline: ModuleType, rounds: int, rev: str = BASELINE_REV) -> list[Figure]:
    w = KVWorkload(nodes=nodes)
    payloads = kv_payloads(w)
    data = batches(payloads)
    events = sum(len(ev) for _, ev in data)
    impls: dict[str, Callable[[], Any]] = {"ours": KVIndex, "base": baseline.KVIndex}
    ingest: dict[str, list[float]] = {k: [] for k in impls}
    built: dict[str, Any] = {}
    for _ in range(rounds):
        for name, factory in impls.items():
            built[name] = None  # free the previous round's index before building
            built[name], seconds = fill(factory, data)
            ingest[name].append(events / seconds)
    size = f"{nodes} nodes x {w.blocks_per_node} blocks"
    figs = [Figure(BENCH, f"ingest_events_per_s_{nodes}", statistics.median(ingest["ours"]),
                   statistics.median(ingest["base"]), f"kv_index@{rev}", f"{size}: not slower", "1/s")]
    for cands in (50, 1000):
        for case, reqs in requests(w, data, cands).items():
            for chain, ids in reqs[:20]:
                assert built["ours"].match(chain, ids) == built["base"].match(chain, ids), case
            times: dict[str, list[float]] = {k: [] for k in impls}
            for _ in range(rounds):
                for name in impls:
                    times[name].append(match_us(built[name], reqs))
            figs.append(Figure(BENCH, f"match_us_{case}_{cands}c_{nodes}", statistics.median(times["ours"]),
                               statistics.median(times["base"]), f"kv_index@{rev}",
                               f"{size}, {cands} candidates: not slower", "us"))
    built.clear()
    del data
    figs.append(Figure(BENCH, f"bytes_per_entry_{nodes}", bytes_per_entry(KVIndex, payloads),
                       bytes_per_entry(baseline.KVIndex, payloads), f"kv_index@{rev}",
                       f"{size}: linear in entries", "B"))
    return figs


def run(sizes: tuple[int, ...] = (1000,), rounds: int = 5, baseline_rev: str = BASELINE_REV) -> list[Figure]:
    baseline = load_baseline(baseline_rev)
    return [fig for nodes in sizes for fig in run_size(nodes, baseline, rounds, baseline_rev)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    args = parser.parse_args()
    for fig in run(tuple(args.nodes), args.rounds, args.baseline_rev):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
