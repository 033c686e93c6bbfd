"""Router overhead: a request through the geo router against the same request sent
straight to the node, side by side in one run, on the local fabric.

    python -m bench.router_overhead [--requests N]

Requests alternate between the two paths so machine noise hits both alike; figures are
medians. The model is the tiny generated checkpoint with max_tokens=1, so the time is
dominated by HTTP and routing, which is what this measures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import Figure, median, percentile
from localfabric import DEMO_MODEL, FabricSpec, local_fabric

BENCH = "router_overhead"


def run(requests: int) -> list[Figure]:
    body = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1, "temperature": 0}
    with tempfile.TemporaryDirectory() as tmp, local_fabric(
        FabricSpec(work_dir=Path(tmp), regions=("aws:us-east-1",))
    ) as fabric:
        assert fabric.info is not None
        node_url = fabric.info.nodes["aws:us-east-1"].url
        tenant = {"authorization": f"Bearer {fabric.info.keys['global']}"}
        internal = {"authorization": f"Bearer {fabric.info.cluster_token}"}
        via_router: list[float] = []
        direct: list[float] = []
        with httpx.Client(timeout=30) as http:
            for i in range(requests + 5):
                for path in ("router", "direct"):
                    url = (fabric.info.router_url if path == "router" else node_url) + "/v1/chat/completions"
                    t0 = time.perf_counter()
                    r = http.post(url, json=body, headers=tenant if path == "router" else internal)
                    dt = (time.perf_counter() - t0) * 1000
                    r.raise_for_status()
                    if i < 5:
                        continue  # warm-up: connection pools, first-call paths
                    (via_router if path == "router" else direct).append(dt)
    return [
        Figure(BENCH, "p50_latency_ms", median(via_router), median(direct), "direct to node",
               "added (ours - baseline) <= 5 ms: one extra HTTP hop", "ms"),
        Figure(BENCH, "p99_latency_ms", percentile(via_router, 0.99), percentile(direct, 0.99),
               "direct to node", "added (ours - baseline) <= 10 ms", "ms"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    for fig in run(args.requests):
        print(fig.json_line())


if __name__ == "__main__":
    main()
