"""The run's timeline as series per bucket of invoke time: requests/s and errors/s per region,
requests/s per serving node, error counts, the p99 latency of the ok requests, and where
traffic moved between nodes (chaos.report.traffic). report.json holds them; timeline.png
draws them.

Region series answer "did the fabric keep serving"; node series answer "who took over": a
killed node's line falls to zero as its sibling's rises, which a region's total hides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from chaos.checker import join_client, latency_ms, percentile
from chaos.history import History, Outcome
from chaos.report.traffic import Failover, TrafficShift, router_failovers, traffic_shifts

NO_REGION = "none"  # the timeline's region for requests answered without x-meridian-region
NO_NODE = "none"  # the timeline's node for requests answered without x-meridian-node


@dataclass(frozen=True)
class TimelineSeries:
    """Per-bucket series of a run, buckets by invoke time starting at `starts_s[i]`.

    `requests_per_s` and `errors_per_s` map a region (the client's x-meridian-region, or
    NO_REGION) to one rate per bucket; an error is any request that did not end `ok`
    (failed, indeterminate, or never answered). `p99_ms` is the nearest-rank p99 latency
    of the `ok` requests invoked in the bucket, None when there were none.

    `node_requests_per_s` maps a serving node (the client's x-meridian-node, or NO_NODE) to
    one rate per bucket; `nodes` lists them grouped by region (siblings next to each other),
    NO_NODE last, and `node_regions` gives each node's region where any record names it.
    `errors` is the number of errors per bucket over all regions. `failovers` are the
    routers' retries on another node (from their journals), `traffic_shifts` the nodes whose
    traffic fell to zero while a sibling's rose (from the node series alone).
    """

    bucket_s: float
    starts_s: tuple[float, ...]
    regions: tuple[str, ...]
    requests_per_s: Mapping[str, tuple[float, ...]]
    errors_per_s: Mapping[str, tuple[float, ...]]
    p99_ms: tuple[float | None, ...]
    nodes: tuple[str, ...] = ()
    node_regions: Mapping[str, str] = field(default_factory=dict)
    node_requests_per_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    errors: tuple[int, ...] = ()
    failovers: tuple[Failover, ...] = ()
    traffic_shifts: tuple[TrafficShift, ...] = ()


def timeline_series(history: History, bucket_s: float = 1.0) -> TimelineSeries:
    """Requests/s and errors/s per region and per node, the p99 latency (ms) of ok requests,
    and the failovers and traffic shifts, per bucket."""
    if not bucket_s > 0:
        raise ValueError(f"bucket_s must be positive, got {bucket_s}")
    ops = list(join_client(history.client).values())
    if not ops:
        return TimelineSeries(bucket_s, (), (), {}, {}, ())
    # Buckets start at the load start (0) so series of different runs line up.
    first = min(0, math.floor(min(o.invoke_s for o in ops) / bucket_s))
    last = math.floor(max(o.invoke_s for o in ops) / bucket_s)
    n = last - first + 1
    requests: dict[str, list[int]] = {}
    errors: dict[str, list[int]] = {}
    by_node: dict[str, list[int]] = {}
    node_regions: dict[str, str] = {r.node: r.region for r in history.routed}
    latencies: list[list[float]] = [[] for _ in range(n)]
    for op in ops:
        i = math.floor(op.invoke_s / bucket_s) - first
        region = op.region or NO_REGION
        if region not in requests:
            requests[region], errors[region] = [0] * n, [0] * n
        requests[region][i] += 1
        node = op.node or NO_NODE
        by_node.setdefault(node, [0] * n)[i] += 1
        if op.node and op.region:
            node_regions[op.node] = op.region
        if op.outcome is Outcome.OK:
            lat = latency_ms(op)
            if lat is not None:
                latencies[i].append(lat)
        else:
            errors[region][i] += 1
    regions = tuple(sorted(requests, key=lambda r: (r == NO_REGION, r)))
    nodes = tuple(sorted(by_node, key=lambda x: (x == NO_NODE, node_regions.get(x, NO_REGION), x)))
    starts = tuple((first + i) * bucket_s for i in range(n))
    served = {x: by_node[x] for x in nodes if x != NO_NODE}
    return TimelineSeries(
        bucket_s=bucket_s,
        starts_s=starts,
        regions=regions,
        requests_per_s={r: tuple(c / bucket_s for c in requests[r]) for r in regions},
        errors_per_s={r: tuple(c / bucket_s for c in errors[r]) for r in regions},
        p99_ms=tuple(percentile(lat, 99) for lat in latencies),
        nodes=nodes,
        node_regions={x: node_regions[x] for x in sorted(node_regions)},
        node_requests_per_s={x: tuple(c / bucket_s for c in by_node[x]) for x in nodes},
        errors=tuple(sum(errors[r][i] for r in regions) for i in range(n)),
        failovers=router_failovers(history, ops, starts, bucket_s),
        traffic_shifts=traffic_shifts(served, node_regions, starts, bucket_s),
    )
