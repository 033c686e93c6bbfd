"""Which nodes' KV caches this router indexes: every node's, or with `kv_events_max_rtt_ms`
those of the regions within that estimated round trip of `router_location`.

Why: an exact KV index is linear in the blocks it holds (geo_router.state.kv_index, ~75 bytes a
block), so a router that indexes a whole 10,000-node fleet at 512 blocks a node holds 374 MiB
for it, and subscribes to 10,000 event streams. Scheduling systems scope theirs: llm-d's
scheduler indexes its InferencePool, Dynamo's KV router its deployment. A geo router's
clients are near it and its candidates are drawn nearest region first (geo_router.selection.candidates),
so the caches of far regions seldom decide where a request goes; a scope keeps the exact index
where it decides and leaves the rest to the routing history (geo_router.state.prefix_history), which
matches nodes without KV events already. The scope is a set of region names computed once per
table whose regions changed, so `covers` is one set lookup on the request path.

A `router_location` that names no region of the table and is no "lat,lon" cannot centre a
scope: every node is indexed then (the unscoped behaviour, never fewer nodes than intended),
with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from meridian.contracts import RegionInfo, RoutingNode
from meridian.geo import Point, region_rtt_ms, resolve_location
from meridian.settings.router import RouterSettings

from .table import LoadedTable

log = logging.getLogger(__name__)


class KVScope:
    """The regions whose nodes are indexed (all of them unless a bound is set)."""

    def __init__(self, settings: RouterSettings) -> None:
        self._max_rtt_ms = settings.kv_events_max_rtt_ms
        self._location = settings.router_location
        self._regions_seen: Mapping[str, RegionInfo] | None = None
        # None: every region.
        self._regions: frozenset[str] | None = None
        self._warned = False

    def update(self, loaded: LoadedTable) -> bool:
        """Follow `loaded`'s regions; True when the set of regions in scope changed."""
        if self._max_rtt_ms is None or loaded.regions is self._regions_seen:
            return False
        self._regions_seen = loaded.regions
        before = self._regions
        self._regions = self._within(loaded.regions)
        return self._regions != before

    def covers(self, node: RoutingNode) -> bool:
        """Whether `node`'s KV cache is indexed (its events subscribed to)."""
        return self._regions is None or node.region in self._regions

    def regions(self) -> frozenset[str] | None:
        """The regions in scope; None for every one."""
        return self._regions

    def _within(self, regions: Mapping[str, RegionInfo]) -> frozenset[str] | None:
        assert self._max_rtt_ms is not None
        centre = resolve_location(self._location, regions)
        if centre is None:
            if not self._warned:
                self._warned = True
                log.warning("router_location %r is no region of the routing table nor a 'lat,lon': "
                            "indexing the KV caches of every node, not those within %g ms",
                            self._location, self._max_rtt_ms)
            return None
        return regions_within(centre, regions, self._max_rtt_ms)


def regions_within(centre: Point, regions: Mapping[str, RegionInfo], max_rtt_ms: float) -> frozenset[str]:
    """The regions whose estimated round trip from `centre` is at most `max_rtt_ms`."""
    return frozenset(name for name, region in regions.items() if region_rtt_ms(centre, region) <= max_rtt_ms)
