"""A flow-control pool's capacity, read off the routing table, node health and node reports.

The pool of (zone, model) is the READY replicas of the model in the regions the zone may be
served in (residency first, as selection counts them), less the ejected: their batch slots
(`max_num_seqs` as each node registered it, else `flow_default_slots`), what other routers
have there, and what they published of themselves. With Redis, the other routers' published
counts and demands (`Peers`: exact per router, at most two sync intervals stale);
without (or while they are not fresh), the nodes' reported running + waiting beyond this
router's own in flight at each scrape, summed over the pool (a node with no fresh report
counts none), and no peers. O(replicas of the pool) a measurement, kept for CACHE_S (a new
routing table is measured at once): the inputs change with probes and ejections, not per
request.
"""

from __future__ import annotations

from collections.abc import Callable

from meridian.clock import Clock
from meridian.settings.router import RouterSettings

from ..state.health import FleetState
from ..state.node_load import NodeLoad
from ..state.table import LoadedTable
from .flow_control import Capacity, Peers, PoolKey

# A pool's capacity is read again after this long (or at once for a new routing table): its
# inputs change with probes (once a second) and ejections, and a request should not pay for
# the sum over the pool's replicas that the previous one just made.
CACHE_S = 0.05


def pool_capacity(
    settings: RouterSettings,
    table: Callable[[], LoadedTable | None],
    fleet: FleetState,
    load: Callable[[str], NodeLoad | None],
    clock: Clock,
    peers: Callable[[PoolKey], Peers | None] | None = None,
) -> Callable[[PoolKey], Capacity]:
    """The capacity function flow control asks (no table yet: no slots, nothing held);
    `peers`: the other routers of a pool as they published themselves (None: not known)."""
    default_slots = settings.flow_default_slots
    cache: dict[PoolKey, tuple[float, LoadedTable, Capacity]] = {}

    def capacity(key: PoolKey) -> Capacity:
        loaded = table()
        if loaded is None:
            return Capacity(0)
        now = clock.monotonic()
        hit = cache.get(key)
        if hit is not None and hit[0] > now and hit[1] is loaded:
            return hit[2]
        if len(cache) > 10_000:  # zones x models: never near it, but bounded
            cache.clear()
        measured = _measure(loaded, key, fleet, load, default_slots)
        published = peers(key) if peers is not None else None
        if published is not None:
            measured = Capacity(measured.slots, published.others, published)
        cache[key] = (now + CACHE_S, loaded, measured)
        return measured

    return capacity


def _measure(loaded: LoadedTable, key: PoolKey, fleet: FleetState, load: Callable[[str], NodeLoad | None],
             default_slots: int) -> Capacity:
    """The pool's slots and other routers' requests, summed over its replicas now."""
    zone, model = key
    slots = others = 0
    for name, nodes in loaded.ready_by_model_region.get(model, {}).items():
        region = loaded.regions.get(name)
        if region is None or not region.admits(zone):
            continue
        for node in nodes:
            if fleet.is_ejected(node.node_id):
                continue
            slots += node.max_num_seqs or default_slots
            reported = load(node.node_id)
            if reported is not None:
                others += reported.running + reported.waiting - reported.own_in_flight
    # Summed before clamping: a node that counts a request this router has just seen end
    # (or not yet seen start) is one off either way, and the errors cancel over the pool.
    return Capacity(slots, max(0, others))
