"""FleetState shared by several routers through Redis: a node one router ejected, all skip.

The ejection rules are geo_router.state.health's. Selection reads health synchronously on every
request, so Redis is never on that path: this router reads and writes a local view, and a
background task publishes its ejections and merges the other routers' every
`fleet_sync_interval_s`. An ejection is the key `<prefix>ejected:<node_id>` =
{"ejected_until": <epoch s>, "ejections": <n>}, expiring with the ejection (n is the backoff
level, so a router that ejects the node next continues the backoff); the sorted set
`<prefix>ejected` (scored by ejected-until) indexes them, so a sync costs O(ejected nodes),
not a scan of the keyspace. An answered request anywhere, or an early return (`uneject`),
deletes the key. Writers race last-wins: two routers ejecting the same node within one
interval is harmless. The max ejected percent counts every ejection this router knows of,
its own and the others'; two routers ejecting at once may together exceed it by one node each.
While Redis is unreachable the router keeps its own view and retries in the background.
Consecutive-error counts below the ejection threshold and in-flight counts are this
router's own and never leave it.
"""

from __future__ import annotations

import json
import logging
import math

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.router import RouterSettings

from .health import EjectionPolicy, FailureKind, InProcessFleetState, NodeHealth
from .redis_sync import RedisMirror

log = logging.getLogger(__name__)

# Index entries are pruned this long after their ejection ended, so a router whose clock is
# somewhat behind does not lose its entries to another's pruning.
_INDEX_GRACE_S = 60.0
# A key gone while our copy still has more ejection left than this was deleted by a success
# at another router; less means it merely expired (our copy lags Redis by a sync's latency).
_EXPIRY_SLACK_S = 0.1


class RedisFleetState(InProcessFleetState, RedisMirror):
    """FleetState whose ejections are shared by every router on the same Redis.

    The local view is InProcessFleetState's (the same rules, records and in-flight counts);
    this class adds what it publishes and merges. A record's `shared` says Redis holds its
    ejection as we do; consecutive failures stay this router's own, the backoff level is shared.
    """

    task_name = "fleet-health-sync"
    while_down = "node health stays local to this router"
    once_back = "node health is shared with the other routers"
    decode_responses = True

    def __init__(
        self,
        redis_url: str,
        *,
        policy: EjectionPolicy,
        sync_interval_s: float = 0.5,
        timeout_s: float = 1.0,
        key_prefix: str = "meridian:router:",
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        InProcessFleetState.__init__(
            self,
            policy.base_s,
            policy.max_s,
            clock,
            consecutive_failures_to_eject=policy.consecutive_failures,
            max_ejected_percent=policy.max_percent,
        )
        RedisMirror.__init__(self, redis_url, timeout_s=timeout_s, sync_interval_s=sync_interval_s, clock=clock)
        self._key_prefix = f"{key_prefix}ejected:"
        self._index = f"{key_prefix}ejected"
        self._dirty: set[str] = set()  # nodes whose change Redis has not seen yet
        self._cleared: set[str] = set()  # of those, nodes whose ejection ended early here

    @classmethod
    def from_settings(cls, settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> RedisFleetState:
        if not settings.redis_url:
            raise ValueError("RedisFleetState needs settings.redis_url")
        return cls(
            settings.redis_url,
            policy=EjectionPolicy.from_settings(settings),
            sync_interval_s=settings.fleet_sync_interval_s,
            timeout_s=settings.redis_timeout_s,
            key_prefix=settings.fleet_key_prefix,
            clock=clock,
        )

    # --- FleetState: local and synchronous, never touches Redis ------------------------------

    def record_success(self, node_id: str) -> None:
        # Called on every answered request: only a node with a record costs anything, and
        # only one that was ejected has anything in Redis to forgive.
        h = self._nodes.get(node_id)
        was_ejected = h is not None and h.ejections > 0
        super().record_success(node_id)
        if was_ejected:
            self._publish(node_id)

    def record_failure(self, node_id: str, kind: FailureKind = FailureKind.UNREACHABLE) -> float:
        duration = super().record_failure(node_id, kind)
        if duration > 0:
            self._nodes[node_id].shared = False
            self._cleared.discard(node_id)
            self._publish(node_id)
        return duration

    def uneject(self, node_id: str) -> bool:
        if not super().uneject(node_id):
            return False
        self._nodes[node_id].shared = False
        self._cleared.add(node_id)
        self._publish(node_id)
        return True

    def _keep_record(self, node_id: str) -> bool:
        # A node that left the table: its ejection in Redis simply expires, unless a change
        # of ours is still to be told.
        return node_id in self._dirty

    # --- background sync -------------------------------------------------------------------

    async def _flush(self) -> None:
        if self._dirty:
            await self.sync_once()

    def _publish(self, node_id: str) -> None:
        self._dirty.add(node_id)
        # A local ejection is published at once, not at the next tick.
        self._sync_loop.wake()

    async def _push(self) -> None:
        if not self._dirty:
            return
        batch, self._dirty = self._dirty, set()
        cleared, self._cleared = self._cleared & batch, self._cleared - batch
        published: list[str] = []
        now, wall_now = self._clock.monotonic(), self._clock.time()
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                for node_id in batch:
                    h = self._nodes.get(node_id)
                    # No backoff level left: the node answered here, Redis must forget it.
                    if h is None or h.ejections == 0 or node_id in cleared:
                        pipe.delete(self._key(node_id))
                        pipe.zrem(self._index, node_id)
                        continue
                    remaining_s = h.ejected_until - now
                    if remaining_s <= 0:
                        continue  # over before it could be shared
                    ejected_until = wall_now + remaining_s
                    value = json.dumps({"ejected_until": ejected_until, "ejections": h.ejections})
                    pipe.set(self._key(node_id), value, px=max(1, math.ceil(remaining_s * 1000)))
                    pipe.zadd(self._index, {node_id: ejected_until})
                    published.append(node_id)
                await pipe.execute()
        except BaseException:
            self._dirty |= batch
            # Unless the node was ejected again meanwhile, its early end is still to be told.
            self._cleared |= {n for n in cleared if self.ejected_for_s(n) == 0}
            raise
        for node_id in published:
            h = self._nodes.get(node_id)
            if h is not None and node_id not in self._dirty:
                h.shared = True

    async def _pull(self) -> None:
        horizon = self._clock.time() - _INDEX_GRACE_S
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self._index, "-inf", horizon)
            pipe.zrange(self._index, 0, -1)
            _, members = await pipe.execute()
        remote: dict[str, tuple[int, float]] = {}
        if members:
            async with self._redis.pipeline(transaction=False) as pipe:
                for node_id in members:
                    pipe.get(self._key(node_id))
                    # Time left as Redis counts it: immune to clock skew between routers.
                    pipe.pttl(self._key(node_id))
                replies = await pipe.execute()
            for node_id, raw, ttl_ms in zip(members, replies[::2], replies[1::2], strict=True):
                ejections = _ejections(raw)
                if ejections is not None and ttl_ms > 0:
                    remote[node_id] = (ejections, ttl_ms / 1000)
        self._merge(remote)

    def _merge(self, remote: dict[str, tuple[int, float]]) -> None:
        now = self._clock.monotonic()
        for node_id, h in list(self._nodes.items()):
            if node_id in remote or node_id in self._dirty or not h.shared:
                continue
            if h.ejected_until - now > _EXPIRY_SLACK_S:
                h.reset()  # another router saw it answer
                self._forget_if_clean(node_id, h)
            else:
                h.shared = False  # expired: keep the count, so the next ejection is longer
        for node_id, (ejections, remaining_s) in remote.items():
            if node_id in self._dirty:
                continue  # our newer news goes out with the next push
            h = self._nodes.setdefault(node_id, NodeHealth())
            h.ejections = max(h.ejections, ejections)
            h.ejected_until = now + remaining_s
            h.shared = True

    def _key(self, node_id: str) -> str:
        return self._key_prefix + node_id


def _ejections(raw: object) -> int | None:
    """The backoff level in a stored ejection, None when the value is missing or foreign."""
    if not isinstance(raw, str):
        return None
    try:
        value = json.loads(raw)
        # "failures": what routers before the consecutive-error threshold wrote.
        ejections = value["ejections"] if "ejections" in value else value["failures"]
    except (ValueError, KeyError, TypeError):
        return None
    return ejections if isinstance(ejections, int) and ejections > 0 else None
