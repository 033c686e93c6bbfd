"""Flow control's work counters shared by every router through Redis.

A tenant that spreads its requests over several routers must not get a fair share at each:
the virtual token counters (geo_router.admission.flow_queue) are one per tenant and pool for
the whole fleet. Each router keeps its pools' counters locally, so dispatch never waits on
Redis, and a background sync (RedisMirror, every `fleet_sync_interval_s`) adds what this
router charged since the last sync to the shared hash of each pool (HINCRBYFLOAT: routers'
charges add up, none overwrites another's) and reads the fleet's totals back.

**How stale, and what that costs.** A router sees the other routers' charges at most one
sync interval (plus a Redis round trip) late. In that time a tenant may be served on other
routers the work of one interval beyond its share before this router's ordering counts it:
at 0.5 s and a tenant served at most R tokens/s fleet-wide, an error of at most R x 0.5 s
tokens, which later dispatches pay back (its counter is then that much higher). The ordering
stays exact for what this router itself dispatches. While Redis is unreachable the counters
are this router's own (the local charges are kept and published once it is back).

Charges add up; a lift (a tenant that starts to wait raised to the least waiting counter)
does not: it is "at least this", published as such (`Pending`: the charges before it, the
floor, the charges after; applied in Redis by one script). As a charge of the difference, two
routers lifting a returning tenant in the same interval each added the whole gap, and a
tenant idle for an hour was pushed an hour's work above everyone and starved for as long.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.router import RouterSettings

from ..state.redis_sync import RedisMirror
from .flow_control import PoolKey
from .flow_queue import WorkCounters

# A pool's hash lives this long after its last sync: an idle pool's counters go, as a new
# pool's would start (every tenant level).
_TTL_S = 3600

# x -> max(x + before, floor) + after, on one tenant's field, at once.
_APPLY = """
local now = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local new = math.max(now + tonumber(ARGV[2]), tonumber(ARGV[3])) + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.17g', new))
"""


@dataclass(frozen=True, slots=True)
class Pending:
    """What a router did to one tenant's counter since its last sync, as one map of the
    shared value: x -> max(x + before, floor) + after (no floor: x + before + after).
    Closed under composition, so any run of charges and lifts folds into one."""

    before: float = 0.0
    floor: float | None = None
    after: float = 0.0

    def charged(self, amount: float) -> Pending:
        return Pending(self.before, self.floor, self.after + amount)

    def lifted(self, floor: float) -> Pending:
        raised = floor if self.floor is None else max(self.floor + self.after, floor)
        return Pending(self.before + self.after, raised, 0.0)

    def then(self, later: Pending) -> Pending:
        """This, followed by `later`."""
        shifted = None if self.floor is None else self.floor + self.after + later.before
        if later.floor is None:
            floor = shifted
        else:
            floor = later.floor if shifted is None else max(shifted, later.floor)
        return Pending(self.before + self.after + later.before, floor, later.after)

    def apply(self, value: float) -> float:
        raised = value + self.before if self.floor is None else max(value + self.before, self.floor)
        return raised + self.after


class _PoolCounters:
    """One pool's view of the shared counters (WorkCounters)."""

    def __init__(self, owner: SharedWorkCounters, key: PoolKey) -> None:
        self._owner, self._key = owner, key

    def level(self, tenant: str) -> float:
        return self._owner.levels[self._key].get(tenant, 0.0)

    def charge(self, tenant: str, weighted_work: float) -> None:
        levels = self._owner.levels[self._key]
        levels[tenant] = levels.get(tenant, 0.0) + weighted_work
        pending = self._owner.pending[self._key]
        pending[tenant] = pending[tenant].charged(weighted_work)

    def lift(self, tenant: str, floor: float) -> None:
        levels = self._owner.levels[self._key]
        if levels.get(tenant, 0.0) < floor:
            levels[tenant] = floor
            pending = self._owner.pending[self._key]
            pending[tenant] = pending[tenant].lifted(floor)


class SharedWorkCounters(RedisMirror):
    """Every pool's counters: local, and summed with the other routers' through Redis."""

    task_name = "flow-counters-sync"
    while_down = "flow control orders by this router's own work counters"
    once_back = "flow control's work counters are shared again"
    decode_responses = True

    def __init__(self, redis_url: str, *, key_prefix: str, timeout_s: float, sync_interval_s: float,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(redis_url, timeout_s=timeout_s, sync_interval_s=sync_interval_s, clock=clock)
        self._prefix = f"{key_prefix}flow:"
        # The fleet's totals as last read, plus this router's charges since.
        self.levels: dict[PoolKey, dict[str, float]] = {}
        # This router's charges and lifts not yet applied in Redis.
        self.pending: dict[PoolKey, defaultdict[str, Pending]] = {}

    @classmethod
    def from_settings(cls, settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> SharedWorkCounters:
        if not settings.redis_url:
            raise ValueError("SharedWorkCounters needs settings.redis_url")
        return cls(settings.redis_url, key_prefix=settings.fleet_key_prefix, timeout_s=settings.redis_timeout_s,
                   sync_interval_s=settings.fleet_sync_interval_s, clock=clock)

    def for_pool(self, key: PoolKey) -> WorkCounters:
        self.levels.setdefault(key, {})
        self.pending.setdefault(key, defaultdict(Pending))
        return _PoolCounters(self, key)

    def _redis_key(self, key: PoolKey) -> str:
        zone, model = key
        return f"{self._prefix}{zone}:{model}"

    async def _push(self) -> None:
        # Taken before the await: charges made during the call go with the next sync.
        batch = {key: dict(changes) for key, changes in self.pending.items() if changes}
        for key in batch:
            self.pending[key].clear()
        if not batch:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, changes in batch.items():
                    name = self._redis_key(key)
                    for tenant, change in changes.items():
                        if change.floor is None:  # charges only: they add up with others'
                            pipe.hincrbyfloat(name, tenant, change.before + change.after)
                        else:
                            pipe.eval(_APPLY, 1, name, tenant, change.before, change.floor, change.after)
                    pipe.expire(name, _TTL_S)
                await pipe.execute()
        except Exception:
            for key, changes in batch.items():  # not published: the next sync tries again, first
                pending = self.pending[key]
                for tenant, change in changes.items():
                    pending[tenant] = change.then(pending[tenant])
            raise

    async def _pull(self) -> None:
        keys = list(self.levels)
        if not keys:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(self._redis_key(key))
            answers = await pipe.execute()
        for key, totals in zip(keys, answers, strict=True):
            pending = self.pending.get(key, {})
            merged = {tenant: float(v) for tenant, v in totals.items()}
            for tenant, change in pending.items():  # done here since the push began
                merged[tenant] = change.apply(merged.get(tenant, 0.0))
            self.levels[key] = merged
