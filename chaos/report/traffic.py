"""Where a run's traffic moved between nodes: the routers' failovers and the traffic shifts
seen in the per-node series.

Two sources, because neither sees everything. A router journals every attempt it sends
(`routed` records, attempt 1, 2, ...): a request whose attempt n+1 went to another node than
attempt n failed over there, at that request's invoke time. That is exact, but it shows only
the requests that were in flight or routed before the router ejected the node; after the
ejection nothing is retried, the node simply gets no more traffic, and a deployment's run
may have no journals at all. So the per-node series are read too: a node that served
requests steadily and then none for a while, while a sibling served more, lost its traffic
to that sibling.

A node with few requests per bucket has empty buckets by chance, so a shift needs
SHIFT_MIN_BEFORE requests in the SHIFT_WINDOW_S before it and none in the SHIFT_WINDOW_S
after. At the rate the node had, a silence that long by chance has a probability of at
most e^-SHIFT_MIN_BEFORE (0.25 %).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from chaos.history import ClientOp, History

SHIFT_WINDOW_S = 5.0
SHIFT_MIN_BEFORE = 6


@dataclass(frozen=True)
class Failover:
    """`count` requests invoked in the bucket starting at `at_s` that a router retried on
    `to_node` after `from_node` failed them."""

    at_s: float
    from_node: str
    to_node: str
    count: int


@dataclass(frozen=True)
class TrafficShift:
    """From the bucket starting at `at_s`, `from_node` served nothing and `to_node`, its
    sibling (a node of the same region when it has one), served more than before."""

    at_s: float
    from_node: str
    to_node: str


def router_failovers(
    history: History, ops: Sequence[ClientOp], starts_s: Sequence[float], bucket_s: float
) -> tuple[Failover, ...]:
    """Every change of node between a request's consecutive attempts, counted per bucket of
    its invoke time and per (from, to) pair; requests the client never recorded are left out
    (they have no time)."""
    if not starts_s:
        return ()
    invoked = {op.key: op.invoke_s for op in ops}
    attempts: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for r in history.routed:
        attempts[r.key].append((r.attempt, r.node))
    first = round(starts_s[0] / bucket_s)
    counts: Counter[tuple[int, str, str]] = Counter()
    for key, tries in attempts.items():
        if key not in invoked or len(tries) < 2:
            continue
        tries.sort()
        i = math.floor(invoked[key] / bucket_s) - first
        for (_, a), (_, b) in zip(tries, tries[1:], strict=False):
            if a != b:
                counts[i, a, b] += 1
    return tuple(
        Failover(at_s=starts_s[i], from_node=a, to_node=b, count=c) for (i, a, b), c in sorted(counts.items())
    )


def traffic_shifts(
    counts: Mapping[str, Sequence[int]],
    node_regions: Mapping[str, str],
    starts_s: Sequence[float],
    bucket_s: float,
) -> tuple[TrafficShift, ...]:
    """Nodes whose requests per bucket (`counts`) fell to zero while a sibling's rose; one
    shift per silence (a node that comes back and falls silent again shifts again)."""
    w = max(1, round(SHIFT_WINDOW_S / bucket_s))
    out: list[TrafficShift] = []
    for node, series in counts.items():
        i = w
        while i + w <= len(series):
            if series[i - 1] > 0 and sum(series[i - w : i]) >= SHIFT_MIN_BEFORE and not any(series[i : i + w]):
                to = _taker(node, counts, node_regions, i, w)
                if to is not None:
                    out.append(TrafficShift(at_s=starts_s[i], from_node=node, to_node=to))
                # Past this silence: the next shift needs the node back first.
                while i < len(series) and series[i] == 0:
                    i += 1
            i += 1
    return tuple(sorted(out, key=lambda s: (s.at_s, s.from_node)))


def _taker(
    node: str, counts: Mapping[str, Sequence[int]], node_regions: Mapping[str, str], i: int, w: int
) -> str | None:
    """The node whose requests rose the most from the window before bucket i to the one
    from it: among the node's region's other nodes, or every other node when it has none."""
    region = node_regions.get(node)
    others = [x for x in counts if x != node]
    siblings = [x for x in others if region is not None and node_regions.get(x) == region]
    best: tuple[int, str] | None = None
    for x in siblings or others:
        gain = sum(counts[x][i : i + w]) - sum(counts[x][i - w : i])
        if gain > 0 and (best is None or gain > best[0]):
            best = (gain, x)
    return None if best is None else best[1]
