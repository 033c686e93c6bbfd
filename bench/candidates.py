"""Per-request routing cost against the number of replicas of one model: `select_candidates`
alone, and the whole pick the router makes per request (select, `Affinity.annotate` with
real KV index, routing history and prefix keys, `AffinityPolicy.order`, `Affinity.chosen`).

The table: one model's replicas spread evenly over 30 regions around the world, every one
READY and reporting some load; a global tenant; a client in Washington; 50 conversations
in turn. It runs on the geo_router it imports, so `--compare ROOT` runs it under ROOT's
code (PYTHONPATH) and under this checkout's alternately, in rounds, and prints the median
of each: before and after in one run.

    PYTHONPATH=$PWD .venv/bin/python -m bench.candidates --compare /work/main
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SIZES = (10, 100, 750, 3000)
MODEL = "big-model"
CONVERSATIONS = 50
REGIONS = 30


def _table(replicas: int) -> Any:
    from meridian.contracts import NodeStatus, RegionInfo, RoutingNode, RoutingTable, TenantEntry

    regions = [RegionInfo(name=f"aws:r{i:02d}", provider="aws", location=f"r{i:02d}", zones=["global"],
                          latitude=-60 + (i * 37) % 120, longitude=-180 + (i * 71) % 360) for i in range(REGIONS)]
    nodes = [RoutingNode(node_id=f"n-{i:05d}", region=regions[i % REGIONS].name, url=f"http://10.0.{i // 250}.{i % 250}:1",
                         models=[MODEL], status=NodeStatus.READY) for i in range(replicas)]
    tenant = TenantEntry(key_hash="0" * 64, key_prefix="bench", tenant="bench", zone="global")
    return RoutingTable(version=1, generated_at=datetime.now(UTC), regions=regions, nodes=nodes, tenants=[tenant])


def measure(replicas: int, max_candidates: int | None = None) -> dict[str, float]:
    """Median µs per request of select_candidates and of the whole pick at `replicas`."""
    from geo_router.selection.affinity import Affinity
    from geo_router.selection.candidates import RoutingContext, select_candidates
    from geo_router.selection.policies import AffinityPolicy
    from geo_router.selection.prefix import PrefixKeyBuilder
    from geo_router.state.health import InProcessFleetState
    from geo_router.state.kv_index import KVIndex
    from geo_router.state.node_load import NodeLoad
    from geo_router.state.prefix_history import InProcessPrefixHistory
    from geo_router.state.table import LoadedTable
    from meridian.geo import Point
    from meridian.settings.router import RouterSettings

    bound = {} if max_candidates is None else {"max_candidates": max_candidates}
    settings = RouterSettings(cluster_token="bench", **bound)
    loaded = LoadedTable.build(_table(replicas))
    tenant = loaded.table.tenants[0]
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60)
    client = Point(38.9, -77.0)
    rng = random.Random(1)
    reported = {n.node_id: NodeLoad(running=rng.randrange(4), waiting=rng.randrange(2), kv_usage=rng.random())
                for n in loaded.table.nodes}

    class Loads:
        def load(self, node_id: str) -> NodeLoad | None:
            return reported.get(node_id)

    history = InProcessPrefixHistory(300.0, 100_000)
    affinity = Affinity(loads=Loads(), kv_index=KVIndex(), history=history, prefixes=PrefixKeyBuilder(settings))
    policy = AffinityPolicy.from_settings(settings)
    bounded = "limit" in inspect.signature(select_candidates).parameters
    kwargs: dict[str, Any] = {"limit": settings.max_candidates} if bounded else {}
    payloads = [{"model": MODEL, "messages": [{"role": "system", "content": "You are helpful. " * 20},
                                              {"role": "user", "content": f"conversation {i}: " + "words " * 80}]}
                for i in range(CONVERSATIONS)]

    def select() -> list[Any]:
        return select_candidates(loaded, tenant, MODEL, fleet, client, **kwargs)

    def more(node_ids: Any) -> list[Any]:
        from geo_router.selection.candidates import named_candidates
        return named_candidates(loaded, tenant, MODEL, fleet, client, node_ids)

    def pick(i: int) -> None:
        cands = select()
        payload = payloads[i % CONVERSATIONS]
        extra = (more,) if bounded and len(cands) >= settings.max_candidates else ()
        cands, prefix = affinity.annotate(cands, MODEL, payload, *extra)
        ctx = RoutingContext(tenant=tenant, model=MODEL, stream=False, client_location=client, request_id="r")
        ordered = policy.order(cands, ctx)
        affinity.chosen(ordered[0], MODEL, prefix)

    calls = max(20, min(400, 40_000 // replicas))
    out: dict[str, list[float]] = {"select_us": [], "pick_us": []}
    for i in range(CONVERSATIONS):  # warm the history and the code paths
        pick(i)
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            select()
        out["select_us"].append((time.perf_counter() - t0) / calls * 1e6)
        t0 = time.perf_counter()
        for i in range(calls):
            pick(i)
        out["pick_us"].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in out.items()} | {"candidates": float(len(select()))}


def _run(root: str, sizes: list[int], bound: list[str]) -> dict[str, dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, __file__, "--json", *bound, *map(str, sizes)], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=list(SIZES))
    parser.add_argument("--compare", metavar="ROOT", help="also run under ROOT's code, alternately")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-candidates", type=int, help="the bound (default: RouterSettings')")
    parser.add_argument("--json", action="store_true", help="one JSON object out (used by --compare)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps({str(n): measure(n, args.max_candidates) for n in args.sizes}))
        return
    bound = [] if args.max_candidates is None else ["--max-candidates", str(args.max_candidates)]
    roots = {"after": str(Path(__file__).resolve().parents[1])}
    if args.compare:
        roots = {"before": args.compare, **roots}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in roots}
    for _ in range(args.rounds):
        for name, root in roots.items():
            runs[name].append(_run(root, args.sizes, bound))
    print(f"{'replicas':>8} {'code':>6} {'candidates':>10} {'select µs':>10} {'pick µs':>10}")
    for n in args.sizes:
        for name in roots:
            rows = [r[str(n)] for r in runs[name]]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{n:>8} {name:>6} {med['candidates']:>10.0f} {med['select_us']:>10.1f} {med['pick_us']:>10.1f}")


if __name__ == "__main__":
    main()
