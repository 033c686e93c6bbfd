"""The other routers of a flow-control pool, through Redis: how many requests they have
running there, and how many they are asked for (running + waiting: their demand).

Flow control needs what other routers have running in a pool (geo_router.admission
.flow_control, Several routers). Read off the nodes' reports, that sum is noisy: each node is
scraped at its own moment, so a request that ended on one node and its replacement that
started on another are both counted until the first node's next scrape. With two routers the
figure swung by several slots, more than the reserve a light tenant's request goes into
(bench.flow_control, two routers: B's TTFT p90 1.57 s, 1.55 s of it held at the router).

A router's own count is exact. So every `flow_peers_sync_interval_s` each router publishes,
per pool where it has requests running or waiting, how many it has running and waiting: one
hash per pool, each router's field stamped with Redis's own TIME (routers' clocks need not
agree). The same script drops the fields older than PRESENCE_S and answers the sums of the
others' running and each other's demand (`Peers`), from which flow control splits the pool's
slots among the routers by demand. A router takes its field back from a pool it has left (nothing
running or waiting there), and from every pool when it stops.

**How stale.** A count is read at most two sync intervals after it was true (the other's
publish, then this router's read). What it costs: a request that ended since still counts,
so a light tenant's short requests linger in the reserve's count for about that long (at a
0.5 s interval, the counters' sync, about one slot of a reserve of two, hence an interval of
its own: 0.1 s by default, one small script per active pool per router); a quota follows a
change of demand that late.
A router that stops publishing (gone, or cut off from Redis) stops being counted after
PRESENCE_S; while this router cannot reach Redis its view lapses as well (`peers` answers
None) and flow control falls back to the nodes' reports. Requests that no flow-controlled
router let go (another model's pool on the same replicas, a router with flow control off)
are not in the published counts.
"""

from __future__ import annotations

from collections.abc import Callable

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.router import RouterSettings

from ..state.redis_sync import RedisMirror
from .flow_control import Peers, PoolKey
from .flow_report import default_router_id

# A router's field in a pool counts for this long after its last publish (many sync
# intervals: one late sync must not make a router vanish and the others overfill).
PRESENCE_S = 3.0
# A pool's hash goes this long after its last publish (every field has lapsed long before).
_TTL_S = 60

# Set ARGV[1]'s field to "<Redis's time> <ARGV[5] running> <ARGV[6] demand>" (ARGV[4] ==
# "leave": delete it), delete fields older than ARGV[2] seconds, keep the hash ARGV[3]
# seconds; the sum of the others' running, then each other's demand.
_PUBLISH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if ARGV[4] == 'leave' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%.6f', now) .. ' ' .. ARGV[5] .. ' ' .. ARGV[6])
end
local fields = redis.call('HGETALL', KEYS[1])
local answer = {0}
for i = 1, #fields, 2 do
  local at, r, d = string.match(fields[i + 1], '(%S+) (%S+) (%S+)')
  if at == nil or tonumber(at) < now - tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[1], fields[i])
  elseif fields[i] ~= ARGV[1] then
    answer[1] = answer[1] + tonumber(r)
    table.insert(answer, tonumber(d))
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return answer
"""


class SharedFlowPeers(RedisMirror):
    """This router's requests running per pool, published; the other routers', read back."""

    task_name = "flow-peers-sync"
    while_down = "flow control counts other routers' requests from the nodes' reports"
    once_back = "flow control counts other routers' requests as they publish them again"
    decode_responses = True

    def __init__(self, redis_url: str, *, key_prefix: str, timeout_s: float, sync_interval_s: float,
                 router_id: str, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(redis_url, timeout_s=timeout_s, sync_interval_s=sync_interval_s, clock=clock)
        self._prefix = f"{key_prefix}flow-routers:"
        self._router_id = router_id
        # This router's requests running and waiting per pool where it has any (flow control's
        # `active_pools`), and what to call once the others' are read (its pump).
        self._active: Callable[[], dict[PoolKey, tuple[int, int]]] = dict
        self._read: Callable[[], None] = lambda: None
        self._present: set[PoolKey] = set()
        # Per pool, what the last sync read, and when (the clock's monotonic time).
        self._peers: dict[PoolKey, tuple[float, Peers]] = {}

    @classmethod
    def from_settings(cls, settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> SharedFlowPeers:
        if not settings.redis_url:
            raise ValueError("SharedFlowPeers needs settings.redis_url")
        return cls(settings.redis_url, key_prefix=settings.fleet_key_prefix, timeout_s=settings.redis_timeout_s,
                   sync_interval_s=settings.flow_peers_sync_interval_s, router_id=default_router_id(settings),
                   clock=clock)

    def follow(self, active: Callable[[], dict[PoolKey, tuple[int, int]]], read: Callable[[], None]) -> None:
        """Publish what `active` answers at each sync; call `read` once the others' are read
        (room they made is let go at once, not at flow control's next tick)."""
        self._active, self._read = active, read

    def peers(self, key: PoolKey) -> Peers | None:
        """The other routers' requests and demand in `key` as a sync within PRESENCE_S read
        them; None otherwise (not active there, Redis unreachable)."""
        read = self._peers.get(key)
        if read is None or self._clock.monotonic() - read[0] > PRESENCE_S:
            return None
        return read[1]

    async def _sync(self) -> None:
        active = self._active()
        await self._publish(active, self._present - active.keys())
        self._read()

    async def _flush(self) -> None:
        """At stop: this router's fields go at once, not after PRESENCE_S."""
        await self._publish({}, set(self._present))

    async def _publish(self, active: dict[PoolKey, tuple[int, int]], leaving: set[PoolKey]) -> None:
        calls = [(key, "here", running, running + waiting) for key, (running, waiting) in active.items()]
        calls += [(key, "leave", 0, 0) for key in leaving]
        if not calls:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for key, what, running, demand in calls:
                pipe.eval(_PUBLISH, 1, self._key(key), self._router_id, PRESENCE_S, _TTL_S, what, running, demand)
            answers = await pipe.execute()
        now = self._clock.monotonic()
        for (key, what, _running, demand), answer in zip(calls, answers, strict=True):
            if what == "here":
                self._peers[key] = (now, Peers(int(answer[0]), tuple(int(d) for d in answer[1:]), demand))
            else:
                self._peers.pop(key, None)
        self._present = set(active)

    def _key(self, key: PoolKey) -> str:
        zone, model = key
        return f"{self._prefix}{zone}:{model}"
