"""Tenant rate limits: token buckets on requests and on tokens per minute, for one router or a fleet.

Limits belong to the tenant (`TenantEntry.tenant`): the control plane sets them per tenant and
every API key of the tenant shares them. A tenant has up to two buckets, one per limit it has
(`requests_per_minute`, `tokens_per_minute`; None: no such limit). A bucket refills at
limit/60 per second and holds `burst_s` seconds of it (default 60: a burst of one minute's
worth), starting full. A request is admitted when both buckets have room and is then charged
one request and an up-front token estimate (geo_router.admission.tokens); `settle` corrects the charge
with the answer's real usage. A bucket may go into debt (the answer used more than estimated):
later requests wait until it is paid back. A request whose estimate alone exceeds the whole
token bucket can never be admitted and is refused at once, not told to retry.

Admission is synchronous and local, microseconds: it runs on every request. With Redis,
`RedisRateLimiter` makes N routers enforce one fleet-wide limit (see its docstring).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import TenantEntry
from meridian.settings.router import RouterSettings

from ..state.redis_sync import RedisMirror
from .ratelimit_buckets import (
    EPSILON,
    NO_HEADERS,
    Limit,
    LocalTenant,
    Share,
    SharedTenant,
    bucket_for,
    give_back,
    learn,
    learned_share,
    local_headers,
    refused,
    script_args,
    shared_headers,
    take_sent,
    too_large,
)

log = logging.getLogger(__name__)

DEFAULT_BURST_S = 60.0
# A tenant's local state idle this long is dropped (a new bucket starts full, so nothing is
# lost). Longer than any request, so a settle finds the state its admission left.
_FORGET_S = 600.0
_SWEEP_EVERY_S = 60.0
# A router's first syncs of a tenant divide its level by the whole fleet, not only by the
# routers known to want it (see RedisRateLimiter).
_COLD_SYNCS = 2


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request: the token estimate it was charged (settle it later) and the
    x-ratelimit-* headers to answer with (empty for a tenant without limits)."""

    tenant: TenantEntry
    tokens: int
    headers: Mapping[str, str]


class RateLimiter(Protocol):
    """Admits or refuses (RateLimited) each request of a tenant; synchronous and local."""

    def admit(self, tenant: TenantEntry, tokens: int) -> Admission: ...

    def settle(self, tenant: TenantEntry, estimated: int, actual: int) -> None:
        """Charge `actual - estimated` more tokens (a refund when negative)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def create_rate_limiter(
    settings: RouterSettings, clock: Clock = SYSTEM_CLOCK
) -> InProcessRateLimiter | RedisRateLimiter:
    """Shared through Redis when `settings.redis_url` is set, else this process's own."""
    if settings.redis_url:
        return RedisRateLimiter.from_settings(settings, clock)
    return InProcessRateLimiter.from_settings(settings, clock)


class InProcessRateLimiter:
    """Token buckets in this process: one router's limits (each router's, without Redis)."""

    def __init__(self, *, burst_s: float = DEFAULT_BURST_S, clock: Clock = SYSTEM_CLOCK) -> None:
        self._burst_s = burst_s
        self._clock = clock
        self._tenants: dict[str, LocalTenant] = {}
        self._swept_at = clock.monotonic()
        # By then even a bucket in full debt has refilled.
        self._forget_s = max(_FORGET_S, 2 * burst_s)

    @classmethod
    def from_settings(cls, settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> InProcessRateLimiter:
        return cls(burst_s=settings.rate_limit_burst_s, clock=clock)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def admit(self, tenant: TenantEntry, tokens: int) -> Admission:
        """Charge one request and `tokens`, or raise RateLimited (nothing charged)."""
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return Admission(tenant, tokens, NO_HEADERS)
        now = self._clock.monotonic()
        state = self._state(tenant, now)
        req, tok = state.requests, state.tokens
        if tok is not None and tokens > tok.capacity:
            raise too_large(tenant, tokens, tok.capacity, local_headers(state))
        short: list[tuple[Limit, float]] = []
        if req is not None and req.level < 1 - EPSILON:
            short.append(("requests", req.wait_s(1)))
        if tok is not None and tok.level < tokens - EPSILON:
            short.append(("tokens", tok.wait_s(tokens)))
        if short:
            raise refused(tenant, tokens, short, local_headers(state))
        if req is not None:
            req.take(1)
        if tok is not None:
            tok.take(tokens)
        return Admission(tenant, tokens, local_headers(state))

    def charge(self, tenant: TenantEntry, tokens: int) -> None:
        """Take one request and `tokens` without asking (what another limiter admitted)."""
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return
        state = self._state(tenant, self._clock.monotonic())
        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            state.tokens.take(tokens)

    def settle(self, tenant: TenantEntry, estimated: int, actual: int) -> None:
        """Charge `actual - estimated` more tokens (a refund when negative)."""
        if tenant.tokens_per_minute is None or actual == estimated:
            return
        state = self._state(tenant, self._clock.monotonic())
        if state.tokens is not None:
            state.tokens.take(actual - estimated)

    def _state(self, tenant: TenantEntry, now: float) -> LocalTenant:
        if now - self._swept_at >= _SWEEP_EVERY_S:
            self._sweep(now)
        state = self._tenants.get(tenant.tenant)
        if state is None:
            state = self._tenants[tenant.tenant] = LocalTenant(None, None, now)
        return refreshed(state, tenant, self._burst_s, now)

    def _sweep(self, now: float) -> None:
        # A tenant idle long enough to be full again is the same as a new one: memory stays
        # proportional to the tenants active in the last few minutes.
        self._swept_at = now
        for name in [n for n, s in self._tenants.items() if now - s.used_at >= self._forget_s]:
            del self._tenants[name]


def refreshed(state: LocalTenant, tenant: TenantEntry, burst_s: float, now: float) -> LocalTenant:
    """`state`'s buckets refilled to `now` under the tenant's current limits, and marked used."""
    state.requests = bucket_for(state.requests, tenant.requests_per_minute, burst_s, now)
    state.tokens = bucket_for(state.tokens, tenant.tokens_per_minute, burst_s, now)
    state.used_at = now
    return state


# --- a fleet of routers sharing the limits through Redis -------------------------------------

# Refills, charges and reads one tenant's fleet-wide buckets at Redis's clock, and counts the
# routers with demand for its limits.
# KEYS: the tenant's buckets (hash: per bucket i = 0 requests, 1 tokens: level li, limit pi,
# size ci; ts ms), its routers with demand (zset), the tenants with demand (zset).
# ARGV: router id, mode ("1": has demand, "0": no demand, "peek": read only), demand horizon
# ms, bucket TTL ms, tenant, then for requests and for tokens: per-minute limit (0: none),
# bucket size, used here since the last sync.
# Returns: level of requests, of tokens ("" for no limit), routers with demand, the
# per-minute limits of requests and of tokens.
_BUCKETS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local peek = ARGV[2] == 'peek'
local horizon = tonumber(ARGV[3])
local last = tonumber(redis.call('HGET', KEYS[1], 'ts')) or now
local elapsed = math.max(0, now - last)
local out = {'', '', 0, '', ''}
for i = 0, 1 do
  local per_minute = tonumber(ARGV[6 + 3 * i])
  local cap = tonumber(ARGV[7 + 3 * i])
  if peek then
    per_minute = tonumber(redis.call('HGET', KEYS[1], 'p' .. i)) or 0
    cap = tonumber(redis.call('HGET', KEYS[1], 'c' .. i)) or 0
  end
  if per_minute > 0 and cap > 0 then
    local level = tonumber(redis.call('HGET', KEYS[1], 'l' .. i)) or cap
    level = math.min(cap, level + elapsed * per_minute / 60000)
    if not peek then
      level = math.max(-cap, math.min(cap, level - tonumber(ARGV[8 + 3 * i])))
      redis.call('HSET', KEYS[1], 'l' .. i, tostring(level), 'p' .. i, tostring(per_minute),
                 'c' .. i, tostring(cap))
    end
    out[i + 1] = tostring(level)
    out[i + 4] = tostring(per_minute)
  end
end
if not peek then
  redis.call('HSET', KEYS[1], 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  if ARGV[2] == '1' then
    redis.call('ZADD', KEYS[2], now, ARGV[1])
    redis.call('PEXPIRE', KEYS[2], horizon)
    redis.call('ZADD', KEYS[3], now, ARGV[5])
    redis.call('PEXPIRE', KEYS[3], ARGV[4])
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - horizon)
end
out[3] = redis.call('ZCOUNT', KEYS[2], now - horizon, '+inf')
return out
"""

# Registers this router as alive; counts the routers that are and lists the tenants with demand
# at any router lately. KEYS: routers (zset by last sync), tenants with demand (zset by last
# demand). ARGV: router id, horizon ms, tenant window ms.
_FLEET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[3]))
return {redis.call('ZCARD', KEYS[1]), redis.call('ZRANGE', KEYS[2], 0, -1)}
"""


class RedisRateLimiter(RedisMirror):
    """RateLimiter whose limits hold for every router on the same Redis together.

    Redis is never on the request path. Redis keeps each tenant's fleet-wide buckets (hash
    `<prefix>rl:<tenant>:b`, refilled by a Lua script at Redis's clock), the routers with
    demand for the tenant (`<prefix>rl:<tenant>:r`, sorted set by last demand), the tenants
    with demand anywhere (`<prefix>rl-tenants`) and the live routers (`<prefix>rl-routers`).
    Every `sync_interval_s` a background task publishes what this router used since its last
    sync, and reads back each tenant's fleet level L and the number n of routers with demand
    for it; tenants in use at other routers are read too, so a router knows a spent bucket
    before the tenant's first request reaches it. Until the next sync this router admits
    against its share: L/n plus 1/n of the refill since, less its own use. The shares add up to
    the fleet's level, so bursts at several routers together get one bucket, not n; a tenant
    with demand at one router only gets all of it (n = 1). A router's unused share stays in L
    and is handed out again at the next sync, so uneven traffic still gets the whole rate.

    Routers whose demand for a tenant began at the same time cannot see each other's until
    each has synced: so until a router has synced twice with demand, it divides by the whole
    fleet's size instead, and a tenant it has never heard of starts from 1/fleet of a full
    bucket (and is synced at once). A burst at one router of an idle tenant thus gets 1/fleet of
    the bucket at once and the rest within about two sync intervals.

    Overshoot bound: a router learns the others' use only at its syncs, so the fleet can admit
    beyond the limit by about what the other routers admitted within one sync interval, divided
    among the routers - roughly one sync interval of the tenant's traffic. The worst case is n
    routers starting to hammer an idle tenant at the same instant: (n-1)/2n of a bucket beyond
    it (a quarter with two routers, always less than half). A request too large
    for any share (more than capacity/n) may take from the fleet's whole level, once per router
    per sync. Overshoot is not forgiven: the shared level goes negative (down to minus a full
    bucket) and every router admits less until it is repaid.

    Redis unreachable: each router enforces the tenant's full limit on its own, in its local
    buckets (kept charged all along, so the switch brings no fresh burst). Geo routing sends a
    tenant's clients to nearby routers, so a tenant's traffic is uneven across routers: dividing
    the limit by the router count would refuse tenants within their contract; the price is that
    up to N times the limit can pass fleet-wide while Redis is down. Use while Redis is down is
    not published afterwards. Logged once per 30 s while it lasts.

    Every key has a TTL: a tenant's buckets expire after two bursts (plus 10 s) without use (by
    then they are full, the same as absent), the router sets after the demand horizon.
    """

    task_name = "rate-limit-sync"
    while_down = "each router enforces tenant rate limits on its own"
    once_back = "tenant rate limits are shared with the other routers"
    decode_responses = True

    def __init__(
        self,
        redis_url: str,
        *,
        burst_s: float = DEFAULT_BURST_S,
        sync_interval_s: float = 0.5,
        timeout_s: float = 1.0,
        key_prefix: str = "meridian:router:",
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(redis_url, timeout_s=timeout_s, sync_interval_s=sync_interval_s, clock=clock)
        self._burst_s = burst_s
        self._prefix = f"{key_prefix}rl:"
        self._routers_key = f"{key_prefix}rl-routers"
        self._tenants_key = f"{key_prefix}rl-tenants"
        self._router_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # A router counts as wanting a tenant's limits (or as alive) this long after it said so.
        self._horizon_ms = math.ceil(max(2.0, 4 * sync_interval_s) * 1000)
        # A bucket unused this long has refilled from any debt: it is the same as none.
        self._window_s = 2 * burst_s + 10
        self._window_ms = math.ceil(self._window_s * 1000)
        self._buckets_script = self._redis.register_script(_BUCKETS_LUA)
        self._fleet_script = self._redis.register_script(_FLEET_LUA)
        self._local = InProcessRateLimiter(burst_s=burst_s, clock=clock)
        self._tenants: dict[str, SharedTenant] = {}
        self._fleet_size = 1
        # Local limits until the first sync succeeds.
        self._shared = False

    @classmethod
    def from_settings(cls, settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> RedisRateLimiter:
        if not settings.redis_url:
            raise ValueError("RedisRateLimiter needs settings.redis_url")
        return cls(
            settings.redis_url,
            burst_s=settings.rate_limit_burst_s,
            sync_interval_s=settings.fleet_sync_interval_s,
            timeout_s=settings.redis_timeout_s,
            key_prefix=settings.fleet_key_prefix,
            clock=clock,
        )

    @property
    def redis_reachable(self) -> bool:
        """True while the limits are shared: the last sync succeeded."""
        return self._shared

    @property
    def fleet_size(self) -> int:
        """Routers that synced with Redis lately, this one included (1 before any sync)."""
        return self._fleet_size

    # --- RateLimiter: local and synchronous, never touches Redis -----------------------------

    def admit(self, tenant: TenantEntry, tokens: int) -> Admission:
        """Charge one request and `tokens` against this router's share, or raise RateLimited."""
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return Admission(tenant, tokens, NO_HEADERS)
        if not self._shared:
            return self._local.admit(tenant, tokens)
        now = self._clock.monotonic()
        state = self._state(tenant, now)
        state.demand = True
        since_s = max(0.0, now - state.synced_at)
        req, tok = state.requests, state.tokens
        if tok is not None and tokens > tok.capacity:
            raise too_large(tenant, tokens, tok.capacity, shared_headers(state, since_s))
        short: list[tuple[Limit, float]] = []
        if req is not None and not req.admits(1, since_s, state.routers):
            short.append(("requests", req.wait_s(1, since_s, state.routers)))
        if tok is not None and not tok.admits(tokens, since_s, state.routers):
            short.append(("tokens", tok.wait_s(tokens, since_s, state.routers)))
        if short:
            raise refused(tenant, tokens, short, shared_headers(state, since_s))
        if req is not None:
            req.unpublished += 1
        if tok is not None:
            tok.unpublished += tokens
        # Keeps the fallback's buckets as used as the fleet's: losing Redis is no fresh burst.
        self._local.charge(tenant, tokens)
        return Admission(tenant, tokens, shared_headers(state, since_s))

    def settle(self, tenant: TenantEntry, estimated: int, actual: int) -> None:
        """Charge `actual - estimated` more tokens (a refund when negative)."""
        if tenant.tokens_per_minute is None or actual == estimated:
            return
        self._local.settle(tenant, estimated, actual)
        if self._shared:
            state = self._state(tenant, self._clock.monotonic())
            if state.tokens is not None:
                state.tokens.unpublished += actual - estimated

    def _state(self, tenant: TenantEntry, now: float) -> SharedTenant:
        state = self._tenants.get(tenant.tenant)
        if state is None:
            state = SharedTenant(None, None, self._fleet_size, now, now)
            self._tenants[tenant.tenant] = state
            self._sync_loop.wake()  # learn the real level now, not in up to one interval
        state.requests = self._share(state.requests, tenant.requests_per_minute)
        state.tokens = self._share(state.tokens, tenant.tokens_per_minute)
        state.used_at = now
        return state

    def _share(self, share: Share | None, per_minute: int | None) -> Share | None:
        if per_minute is None:
            return None
        if share is None:
            return Share.provisional(per_minute, self._burst_s)
        share.update(per_minute, self._burst_s)
        return share

    # --- background sync -------------------------------------------------------------------

    async def _sync(self) -> None:
        """One exchange with Redis, switching to the local limits when it fails and back
        when it succeeds."""
        try:
            await self._exchange()
        except Exception:
            if self._shared:
                self._shared = False
                # What was used while Redis was down is not published later: the fleet's
                # buckets refill meanwhile, and a late charge would lock tenants out.
                self._tenants.clear()
            raise
        self._shared = True

    async def _flush(self) -> None:
        if self._shared:
            await self.sync_once()
            # Out of the live routers now, not a demand horizon later.
            await self._redis.zrem(self._routers_key, self._router_id)

    async def _exchange(self) -> None:
        """Publish this router's use and learn the fleet's (all tenants in one pipeline)."""
        # Taken now, before the await: use during the call is published by the next sync.
        batch = [take_sent(name, state) for name, state in self._tenants.items()]
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                await self._fleet_script(keys=[self._routers_key, self._tenants_key],
                                         args=[self._router_id, self._horizon_ms, self._window_ms],
                                         client=pipe)
                for sent in batch:
                    await self._call_buckets(pipe, sent.tenant, "1" if sent.demand else "0",
                                             (sent.state.requests, sent.requests),
                                             (sent.state.tokens, sent.tokens))
                replies = await pipe.execute()
        except BaseException:
            for sent in batch:
                give_back(sent)
            raise
        fleet_size, fleet_tenants = replies[0]
        self._fleet_size = max(1, int(fleet_size))
        synced_at = self._clock.monotonic()
        for sent, reply in zip(batch, replies[1:], strict=True):
            state = sent.state
            state.warm_syncs = state.warm_syncs + 1 if sent.demand else 0
            learn(state, reply, synced_at, self._routers(reply, state.warm_syncs, sent.demand))
        await self._learn_fleet_tenants(fleet_tenants)
        self._forget(set(fleet_tenants), synced_at)

    async def _learn_fleet_tenants(self, fleet_tenants: list[str]) -> None:
        """Read the buckets of tenants other routers use and this one does not know yet."""
        new = [name for name in fleet_tenants if name not in self._tenants]
        if not new:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in new:
                await self._call_buckets(pipe, name, "peek", (None, 0.0), (None, 0.0))
            replies = await pipe.execute()
        synced_at = self._clock.monotonic()
        for name, reply in zip(new, replies, strict=True):
            if name in self._tenants:
                continue  # a request created it meanwhile; its own sync comes next
            requests_level, tokens_level, _, requests_limit, tokens_limit = reply
            state = SharedTenant(
                learned_share(requests_limit, requests_level, self._burst_s),
                learned_share(tokens_limit, tokens_level, self._burst_s),
                self._routers(reply, 0, False),
                synced_at,
                -math.inf,
            )
            if state.requests is not None or state.tokens is not None:
                self._tenants[name] = state

    def _forget(self, fleet_tenants: set[str], now: float) -> None:
        # Out of the fleet's list means no router used the tenant for a whole window, so its
        # buckets are full again: a fresh state is the same.
        for name in [
            name for name, s in self._tenants.items()
            if name not in fleet_tenants and not s.demand and not s.unpublished()
            and now - s.used_at >= self._window_s
        ]:
            del self._tenants[name]

    def _routers(self, reply: list[Any], warm_syncs: int, demand: bool) -> int:
        # Without demand here this router is not in the count, but would be the next one.
        routers = max(1, int(reply[2]) + (0 if demand else 1))
        if warm_syncs < _COLD_SYNCS:
            # Routers whose demand began with ours may not have published it yet.
            routers = max(routers, self._fleet_size)
        return routers

    async def _call_buckets(
        self,
        pipe: Any,
        tenant: str,
        mode: str,
        requests: tuple[Share | None, float],
        tokens: tuple[Share | None, float],
    ) -> None:
        await self._buckets_script(
            keys=[f"{self._prefix}{tenant}:b", f"{self._prefix}{tenant}:r", self._tenants_key],
            args=[self._router_id, mode, self._horizon_ms, self._window_ms, tenant,
                  *script_args(*requests), *script_args(*tokens)],
            client=pipe,
        )


