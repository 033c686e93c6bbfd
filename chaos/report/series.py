"""The run's timeline as series per bucket of invoke time: requests/s and errors/s per region,
and the p99 latency of the ok requests. report.json holds them; timeline.png draws them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from chaos.checker import join_client, latency_ms, percentile
from chaos.history import History, Outcome

NO_REGION = "none"  # the timeline's region for requests answered without x-meridian-region


@dataclass(frozen=True)
class TimelineSeries:
    """Per-bucket series of a run, buckets by invoke time starting at `starts_s[i]`.

    `requests_per_s` and `errors_per_s` map a region (the client's x-meridian-region, or
    NO_REGION) to one rate per bucket; an error is any request that did not end `ok`
    (failed, indeterminate, or never answered). `p99_ms` is the nearest-rank p99 latency
    of the `ok` requests invoked in the bucket, None when there were none.
    """

    bucket_s: float
    starts_s: tuple[float, ...]
    regions: tuple[str, ...]
    requests_per_s: Mapping[str, tuple[float, ...]]
    errors_per_s: Mapping[str, tuple[float, ...]]
    p99_ms: tuple[float | None, ...]


def timeline_series(history: History, bucket_s: float = 1.0) -> TimelineSeries:
    """Requests/s and errors/s per region and the p99 latency (ms) of ok requests, per bucket."""
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
    latencies: list[list[float]] = [[] for _ in range(n)]
    for op in ops:
        i = math.floor(op.invoke_s / bucket_s) - first
        region = op.region or NO_REGION
        if region not in requests:
            requests[region], errors[region] = [0] * n, [0] * n
        requests[region][i] += 1
        if op.outcome is Outcome.OK:
            lat = latency_ms(op)
            if lat is not None:
                latencies[i].append(lat)
        else:
            errors[region][i] += 1
    regions = tuple(sorted(requests, key=lambda r: (r == NO_REGION, r)))
    return TimelineSeries(
        bucket_s=bucket_s,
        starts_s=tuple((first + i) * bucket_s for i in range(n)),
        regions=regions,
        requests_per_s={r: tuple(c / bucket_s for c in requests[r]) for r in regions},
        errors_per_s={r: tuple(c / bucket_s for c in errors[r]) for r in regions},
        p99_ms=tuple(percentile(lat, 99) for lat in latencies),
    )
