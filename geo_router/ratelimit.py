"""Tenant rate limits: token buckets on requests and on tokens per minute, for one router or a fleet.

Limits belong to the tenant (`TenantEntry.tenant`): the control plane sets them per tenant and
every API key of the tenant shares them. A tenant has up to two buckets, one per limit it has
(`requests_per_minute`, `tokens_per_minute`; None: no such limit). A bucket refills at
limit/60 per second and holds `burst_s` seconds of it (default 60: a burst of one minute's
worth), starting full. A request is admitted when both buckets have room and is then charged
one request and an up-front token estimate (geo_router.tokens); `settle` corrects the charge
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
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Protocol

from meridian.contracts import TenantEntry
from meridian.settings import RouterSettings

from .errors import RateLimited
from .redis_sync import RedisSyncLoop, connect_redis

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Limit = Literal["requests", "tokens"]

DEFAULT_BURST_S = 60.0
# A tenant's local state idle this long is dropped (a new bucket starts full, so nothing is
# lost). Longer than any request, so a settle finds the state its admission left.
_FORGET_S = 600.0
_SWEEP_EVERY_S = 60.0
# A router's first syncs of a tenant divide its level by the whole fleet, not only by the
# routers known to want it (see RedisRateLimiter).
_COLD_SYNCS = 2
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
# Refill is float arithmetic: a client retrying exactly when told must not miss by a rounding.
_EPSILON = 1e-6


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


def create_rate_limiter(settings: RouterSettings) -> InProcessRateLimiter | RedisRateLimiter:
    """Shared through Redis when `settings.redis_url` is set, else this process's own."""
    if settings.redis_url:
        return RedisRateLimiter.from_settings(settings)
    return InProcessRateLimiter.from_settings(settings)


# --- one token bucket ---------------------------------------------------------------------


def _capacity(per_minute: int, burst_s: float) -> float:
    # At least one request's worth, or a tiny limit with a short burst would admit nothing.
    return max(1.0, per_minute * burst_s / 60.0)


@dataclass(slots=True)
class _Bucket:
    """A token bucket; `level` may be negative: debt from answers larger than estimated."""

    per_minute: int
    capacity: float
    level: float
    updated_at: float

    @classmethod
    def full(cls, per_minute: int, burst_s: float, now: float) -> _Bucket:
        capacity = _capacity(per_minute, burst_s)
        return cls(per_minute, capacity, capacity, now)

    def refill(self, now: float, per_minute: int, burst_s: float) -> None:
        if per_minute != self.per_minute:  # the control plane changed the limit
            self.per_minute = per_minute
            self.capacity = _capacity(per_minute, burst_s)
        elapsed = now - self.updated_at
        if elapsed > 0:
            self.updated_at = now
            self.level += elapsed * per_minute / 60.0
        if self.level > self.capacity:
            self.level = self.capacity

    def take(self, amount: float) -> None:
        self.level = max(-self.capacity, min(self.capacity, self.level - amount))

    def wait_s(self, need: float) -> float:
        return max(0.0, (need - self.level) * 60.0 / self.per_minute)

    def full_in_s(self) -> float:
        return max(0.0, (self.capacity - self.level) * 60.0 / self.per_minute)


@dataclass(slots=True)
class _LocalTenant:
    requests: _Bucket | None
    tokens: _Bucket | None
    used_at: float


def _bucket_for(
    bucket: _Bucket | None, per_minute: int | None, burst_s: float, now: float
) -> _Bucket | None:
    """`bucket` refilled to `now` under the tenant's current limit (None: no limit)."""
    if per_minute is None:
        return None
    if bucket is None:
        return _Bucket.full(per_minute, burst_s, now)
    bucket.refill(now, per_minute, burst_s)
    return bucket


class InProcessRateLimiter:
    """Token buckets in this process: one router's limits (each router's, without Redis)."""

    def __init__(self, *, burst_s: float = DEFAULT_BURST_S, clock: Clock = time.monotonic) -> None:
        self._burst_s = burst_s
        self._clock = clock
        self._tenants: dict[str, _LocalTenant] = {}
        self._swept_at = clock()
        # By then even a bucket in full debt has refilled.
        self._forget_s = max(_FORGET_S, 2 * burst_s)

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> InProcessRateLimiter:
        return cls(burst_s=settings.rate_limit_burst_s)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def admit(self, tenant: TenantEntry, tokens: int) -> Admission:
        """Charge one request and `tokens`, or raise RateLimited (nothing charged)."""
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return Admission(tenant, tokens, _NO_HEADERS)
        now = self._clock()
        state = self._state(tenant, now)
        req, tok = state.requests, state.tokens
        if tok is not None and tokens > tok.capacity:
            raise _too_large(tenant, tokens, tok.capacity, _local_headers(state))
        short: list[tuple[Limit, float]] = []
        if req is not None and req.level < 1 - _EPSILON:
            short.append(("requests", req.wait_s(1)))
        if tok is not None and tok.level < tokens - _EPSILON:
            short.append(("tokens", tok.wait_s(tokens)))
        if short:
            raise _refused(tenant, tokens, short, _local_headers(state))
        if req is not None:
            req.take(1)
        if tok is not None:
            tok.take(tokens)
        return Admission(tenant, tokens, _local_headers(state))

    def charge(self, tenant: TenantEntry, tokens: int) -> None:
        """Take one request and `tokens` without asking (what another limiter admitted)."""
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return
        state = self._state(tenant, self._clock())
        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            state.tokens.take(tokens)

    def settle(self, tenant: TenantEntry, estimated: int, actual: int) -> None:
        """Charge `actual - estimated` more tokens (a refund when negative)."""
        if tenant.tokens_per_minute is None or actual == estimated:
            return
        state = self._state(tenant, self._clock())
        if state.tokens is not None:
            state.tokens.take(actual - estimated)

    def _state(self, tenant: TenantEntry, now: float) -> _LocalTenant:
        if now - self._swept_at >= _SWEEP_EVERY_S:
            self._sweep(now)
        state = self._tenants.get(tenant.tenant)
        if state is None:
            state = self._tenants[tenant.tenant] = _LocalTenant(None, None, now)
        state.requests = _bucket_for(state.requests, tenant.requests_per_minute, self._burst_s, now)
        state.tokens = _bucket_for(state.tokens, tenant.tokens_per_minute, self._burst_s, now)
        state.used_at = now
        return state

    def _sweep(self, now: float) -> None:
        # A tenant idle long enough to be full again is the same as a new one: memory stays
        # proportional to the tenants active in the last few minutes.
        self._swept_at = now
        for name in [n for n, s in self._tenants.items() if now - s.used_at >= self._forget_s]:
            del self._tenants[name]


def _local_headers(state: _LocalTenant) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
        if bucket is not None:
            _add_headers(headers, kind, bucket.per_minute, bucket.level, bucket.full_in_s())
    return headers


# --- answers: headers and errors ------------------------------------------------------------


_HEADER_NAMES = {
    kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
    for kind in ("requests", "tokens")
}


def _add_headers(headers: dict[str, str], kind: str, limit: int, remaining: float, reset_s: float) -> None:
    limit_name, remaining_name, reset_name = _HEADER_NAMES[kind]
    headers[limit_name] = str(limit)
    headers[remaining_name] = str(int(remaining)) if remaining > 0 else "0"
    headers[reset_name] = _duration(reset_s)


def _duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* form: "250ms", "12s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms" if seconds > 0 else "0ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _refused(
    tenant: TenantEntry, tokens: int, short: list[tuple[Limit, float]], headers: dict[str, str]
) -> RateLimited:
    # Retrying before the longest wait is over would be refused again.
    kind, wait_s = max(short, key=lambda s: s[1])
    retry_after_s = max(1, math.ceil(wait_s))
    headers["retry-after"] = str(retry_after_s)
    headers["retry-after-ms"] = str(max(1, math.ceil(wait_s * 1000)))
    if kind == "requests":
        what = f"requests per min (RPM): Limit {tenant.requests_per_minute}, Requested 1"
    else:
        what = f"tokens per min (TPM): Limit {tenant.tokens_per_minute}, Requested {tokens}"
    return RateLimited(
        f"Rate limit reached for tenant `{tenant.tenant}` on {what}. "
        f"Please try again in {retry_after_s}s.",
        limit=kind,
        retry_after_s=retry_after_s,
        headers=headers,
    )


def _too_large(tenant: TenantEntry, tokens: int, capacity: float, headers: dict[str, str]) -> RateLimited:
    # OpenAI's SDKs honour x-should-retry: waiting would not help this request.
    headers["x-should-retry"] = "false"
    return RateLimited(
        f"Request too large for tenant `{tenant.tenant}` on tokens per min (TPM): "
        f"Limit {tenant.tokens_per_minute}, Requested {tokens} (prompt characters / 4 plus the "
        f"completion budget). At most {math.floor(capacity)} tokens can ever be admitted at once, "
        "so this request never will be: lower max_tokens or shorten the prompt.",
        limit="tokens",
        retry_after_s=None,
        headers=headers,
    )


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


@dataclass(slots=True)
class _Share:
    """This router's view of one fleet-wide bucket of a tenant."""

    per_minute: int
    capacity: float
    level: float  # the fleet's level when last synced (our published use included)
    unpublished: float  # used here since that sync's snapshot; negative for refunds

    @classmethod
    def provisional(cls, per_minute: int, burst_s: float) -> _Share:
        capacity = _capacity(per_minute, burst_s)
        return cls(per_minute, capacity, capacity, 0.0)

    def update(self, per_minute: int, burst_s: float) -> None:
        if per_minute != self.per_minute:
            self.per_minute = per_minute
            self.capacity = _capacity(per_minute, burst_s)
            self.level = min(self.level, self.capacity)

    def fleet_left(self, since_sync_s: float) -> float:
        """What the fleet had left at the last sync, refilled since, less our use since."""
        return min(self.capacity, self.level + since_sync_s * self.per_minute / 60.0) - self.unpublished

    def mine(self, since_sync_s: float, routers: int) -> float:
        """What this router may still use before the next sync: its share of the fleet's."""
        own = min(self.capacity, self.level + since_sync_s * self.per_minute / 60.0) / routers
        return own - self.unpublished

    def admits(self, need: float, since_sync_s: float, routers: int) -> bool:
        mine = self.mine(since_sync_s, routers)
        if mine >= need - _EPSILON:
            return True
        # A request larger than any share can be would never fit one: it may take from the
        # fleet's whole level, once per sync (the router is then in debt until it syncs).
        return (need > self.capacity / routers and mine >= 0
                and self.fleet_left(since_sync_s) >= need - _EPSILON)

    def wait_s(self, need: float, since_sync_s: float, routers: int) -> float:
        # The share refills at 1/routers of the rate.
        return max(0.0, (need - self.mine(since_sync_s, routers)) * routers * 60.0 / self.per_minute)


@dataclass(slots=True)
class _SharedTenant:
    requests: _Share | None
    tokens: _Share | None
    routers: int  # routers its level is divided among until the next sync (>= 1)
    synced_at: float  # when the levels were learned (the limiter's clock)
    used_at: float  # last admission or settle here; -inf when only learned from the fleet
    demand: bool = False  # asked here since the last sync
    warm_syncs: int = 0  # consecutive syncs with demand here

    def unpublished(self) -> bool:
        return any(s is not None and s.unpublished != 0 for s in (self.requests, self.tokens))


@dataclass(slots=True)
class _Sent:
    tenant: str
    state: _SharedTenant
    requests: float
    tokens: float
    demand: bool


class RedisRateLimiter:
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

    def __init__(
        self,
        redis_url: str,
        *,
        burst_s: float = DEFAULT_BURST_S,
        sync_interval_s: float = 0.5,
        timeout_s: float = 1.0,
        key_prefix: str = "meridian:router:",
        clock: Clock = time.monotonic,
    ) -> None:
        self._burst_s = burst_s
        self._clock = clock
        self._prefix = f"{key_prefix}rl:"
        self._routers_key = f"{key_prefix}rl-routers"
        self._tenants_key = f"{key_prefix}rl-tenants"
        self._router_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # A router counts as wanting a tenant's limits (or as alive) this long after it said so.
        self._horizon_ms = math.ceil(max(2.0, 4 * sync_interval_s) * 1000)
        # A bucket unused this long has refilled from any debt: it is the same as none.
        self._window_s = 2 * burst_s + 10
        self._window_ms = math.ceil(self._window_s * 1000)
        self._redis = connect_redis(redis_url, timeout_s, decode_responses=True)
        self._buckets_script = self._redis.register_script(_BUCKETS_LUA)
        self._fleet_script = self._redis.register_script(_FLEET_LUA)
        self._local = InProcessRateLimiter(burst_s=burst_s, clock=clock)
        self._tenants: dict[str, _SharedTenant] = {}
        self._fleet_size = 1
        # Local limits until the first sync succeeds.
        self._shared = False
        self._sync_loop = RedisSyncLoop(
            self._sync_or_fall_back,
            interval_s=sync_interval_s,
            task_name="rate-limit-sync",
            while_down="each router enforces tenant rate limits on its own",
            once_back="tenant rate limits are shared with the other routers",
            log=log,
            final_flush=self._flush,
        )

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> RedisRateLimiter:
        if not settings.redis_url:
            raise ValueError("RedisRateLimiter needs settings.redis_url")
        return cls(
            settings.redis_url,
            burst_s=settings.rate_limit_burst_s,
            sync_interval_s=settings.fleet_sync_interval_s,
            timeout_s=settings.redis_timeout_s,
            key_prefix=settings.fleet_key_prefix,
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
            return Admission(tenant, tokens, _NO_HEADERS)
        if not self._shared:
            return self._local.admit(tenant, tokens)
        now = self._clock()
        state = self._state(tenant, now)
        state.demand = True
        since_s = max(0.0, now - state.synced_at)
        req, tok = state.requests, state.tokens
        if tok is not None and tokens > tok.capacity:
            raise _too_large(tenant, tokens, tok.capacity, _shared_headers(state, since_s))
        short: list[tuple[Limit, float]] = []
        if req is not None and not req.admits(1, since_s, state.routers):
            short.append(("requests", req.wait_s(1, since_s, state.routers)))
        if tok is not None and not tok.admits(tokens, since_s, state.routers):
            short.append(("tokens", tok.wait_s(tokens, since_s, state.routers)))
        if short:
            raise _refused(tenant, tokens, short, _shared_headers(state, since_s))
        if req is not None:
            req.unpublished += 1
        if tok is not None:
            tok.unpublished += tokens
        # Keeps the fallback's buckets as used as the fleet's: losing Redis is no fresh burst.
        self._local.charge(tenant, tokens)
        return Admission(tenant, tokens, _shared_headers(state, since_s))

    def settle(self, tenant: TenantEntry, estimated: int, actual: int) -> None:
        """Charge `actual - estimated` more tokens (a refund when negative)."""
        if tenant.tokens_per_minute is None or actual == estimated:
            return
        self._local.settle(tenant, estimated, actual)
        if self._shared:
            state = self._state(tenant, self._clock())
            if state.tokens is not None:
                state.tokens.unpublished += actual - estimated

    def _state(self, tenant: TenantEntry, now: float) -> _SharedTenant:
        state = self._tenants.get(tenant.tenant)
        if state is None:
            state = _SharedTenant(None, None, self._fleet_size, now, now)
            self._tenants[tenant.tenant] = state
            self._sync_loop.wake()  # learn the real level now, not in up to one interval
        state.requests = self._share(state.requests, tenant.requests_per_minute)
        state.tokens = self._share(state.tokens, tenant.tokens_per_minute)
        state.used_at = now
        return state

    def _share(self, share: _Share | None, per_minute: int | None) -> _Share | None:
        if per_minute is None:
            return None
        if share is None:
            return _Share.provisional(per_minute, self._burst_s)
        share.update(per_minute, self._burst_s)
        return share

    # --- background sync -------------------------------------------------------------------

    async def start(self) -> None:
        """Sync once (when Redis answers), then keep syncing in the background."""
        await self._sync_loop.start()

    async def stop(self) -> None:
        """Stop syncing; publishes what this router used since the last sync (best effort)."""
        await self._sync_loop.stop()
        await self._redis.aclose()

    async def sync_once(self) -> bool:
        """Publish this router's use, learn the fleet's; False (local limits) if Redis failed."""
        return await self._sync_loop.sync_once()

    async def _sync_or_fall_back(self) -> None:
        """_sync, switching to the local limits when it fails and back when it succeeds."""
        try:
            await self._sync()
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

    async def _sync(self) -> None:
        # Taken now, before the await: use during the call is published by the next sync.
        batch = [_take(name, state) for name, state in self._tenants.items()]
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
                _give_back(sent)
            raise
        fleet_size, fleet_tenants = replies[0]
        self._fleet_size = max(1, int(fleet_size))
        synced_at = self._clock()
        for sent, reply in zip(batch, replies[1:], strict=True):
            state = sent.state
            state.warm_syncs = state.warm_syncs + 1 if sent.demand else 0
            _learn(state, reply, synced_at, self._routers(reply, state.warm_syncs, sent.demand))
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
        synced_at = self._clock()
        for name, reply in zip(new, replies, strict=True):
            if name in self._tenants:
                continue  # a request created it meanwhile; its own sync comes next
            requests_level, tokens_level, _, requests_limit, tokens_limit = reply
            state = _SharedTenant(
                _learned_share(requests_limit, requests_level, self._burst_s),
                _learned_share(tokens_limit, tokens_level, self._burst_s),
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
        requests: tuple[_Share | None, float],
        tokens: tuple[_Share | None, float],
    ) -> None:
        await self._buckets_script(
            keys=[f"{self._prefix}{tenant}:b", f"{self._prefix}{tenant}:r", self._tenants_key],
            args=[self._router_id, mode, self._horizon_ms, self._window_ms, tenant,
                  *_script_args(*requests), *_script_args(*tokens)],
            client=pipe,
        )


def _take(name: str, state: _SharedTenant) -> _Sent:
    sent = _Sent(name, state, _take_unpublished(state.requests), _take_unpublished(state.tokens),
                 state.demand)
    state.demand = False
    return sent


def _take_unpublished(share: _Share | None) -> float:
    if share is None:
        return 0.0
    used, share.unpublished = share.unpublished, 0.0
    return used


def _give_back(sent: _Sent) -> None:
    if sent.state.requests is not None:
        sent.state.requests.unpublished += sent.requests
    if sent.state.tokens is not None:
        sent.state.tokens.unpublished += sent.tokens
    sent.state.demand |= sent.demand


def _script_args(share: _Share | None, used: float) -> tuple[float, float, float]:
    if share is None:
        return (0, 0, 0)
    return (share.per_minute, share.capacity, used)


def _learn(state: _SharedTenant, reply: list[Any], synced_at: float, routers: int) -> None:
    for share, level in ((state.requests, reply[0]), (state.tokens, reply[1])):
        # An empty level: the limit did not exist when the sync started (it was added since).
        if share is not None and level != "":
            share.level = min(share.capacity, float(level))
    state.routers = routers
    state.synced_at = synced_at


def _learned_share(per_minute: str, level: str, burst_s: float) -> _Share | None:
    if per_minute == "" or level == "":
        return None
    share = _Share.provisional(round(float(per_minute)), burst_s)
    share.level = min(share.capacity, float(level))
    return share


def _shared_headers(state: _SharedTenant, since_s: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, share in (("requests", state.requests), ("tokens", state.tokens)):
        if share is not None:
            left = share.fleet_left(since_s)
            reset_s = max(0.0, (share.capacity - left) * 60.0 / share.per_minute)
            _add_headers(headers, kind, share.per_minute, left, reset_s)
    return headers
