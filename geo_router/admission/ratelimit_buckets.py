"""The arithmetic of tenant rate limits: token buckets, fleet shares, and the answers they give.

Pure functions and dataclasses with no I/O, shared by geo_router.admission.ratelimit's two limiters:
`Bucket` (one router's own token bucket), `Share` (one router's view of a fleet-wide bucket
kept in Redis: its share of the fleet's level until the next sync), the x-ratelimit-*
headers and the RateLimited refusals both answer with. See geo_router.admission.ratelimit for the
model; here is only how it is computed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from meridian.contracts import TenantEntry

from ..errors import RateLimited

Limit = Literal["requests", "tokens"]

NO_HEADERS: Mapping[str, str] = MappingProxyType({})
# Refill is float arithmetic: a client retrying exactly when told must not miss by a rounding.
EPSILON = 1e-6


def bucket_capacity(per_minute: int, burst_s: float) -> float:
    # At least one request's worth, or a tiny limit with a short burst would admit nothing.
    return max(1.0, per_minute * burst_s / 60.0)


@dataclass(slots=True)
class Bucket:
    """A token bucket; `level` may be negative: debt from answers larger than estimated."""

    per_minute: int
    capacity: float
    level: float
    updated_at: float

    @classmethod
    def full(cls, per_minute: int, burst_s: float, now: float) -> Bucket:
        capacity = bucket_capacity(per_minute, burst_s)
        return cls(per_minute, capacity, capacity, now)

    def refill(self, now: float, per_minute: int, burst_s: float) -> None:
        if per_minute != self.per_minute:  # the control plane changed the limit
            self.per_minute = per_minute
            self.capacity = bucket_capacity(per_minute, burst_s)
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
class LocalTenant:
    requests: Bucket | None
    tokens: Bucket | None
    used_at: float


def bucket_for(
    bucket: Bucket | None, per_minute: int | None, burst_s: float, now: float
) -> Bucket | None:
    """`bucket` refilled to `now` under the tenant's current limit (None: no limit)."""
    if per_minute is None:
        return None
    if bucket is None:
        return Bucket.full(per_minute, burst_s, now)
    bucket.refill(now, per_minute, burst_s)
    return bucket


def local_headers(state: LocalTenant) -> dict[str, str]:
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


def refused(
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


def too_large(tenant: TenantEntry, tokens: int, capacity: float, headers: dict[str, str]) -> RateLimited:
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


@dataclass(slots=True)
class Share:
    """This router's view of one fleet-wide bucket of a tenant."""

    per_minute: int
    capacity: float
    level: float  # the fleet's level when last synced (our published use included)
    unpublished: float  # used here since that sync's snapshot; negative for refunds

    @classmethod
    def provisional(cls, per_minute: int, burst_s: float) -> Share:
        capacity = bucket_capacity(per_minute, burst_s)
        return cls(per_minute, capacity, capacity, 0.0)

    def update(self, per_minute: int, burst_s: float) -> None:
        if per_minute != self.per_minute:
            self.per_minute = per_minute
            self.capacity = bucket_capacity(per_minute, burst_s)
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
        if mine >= need - EPSILON:
            return True
        # A request larger than any share can be would never fit one: it may take from the
        # fleet's whole level, once per sync (the router is then in debt until it syncs).
        return (need > self.capacity / routers and mine >= 0
                and self.fleet_left(since_sync_s) >= need - EPSILON)

    def wait_s(self, need: float, since_sync_s: float, routers: int) -> float:
        # The share refills at 1/routers of the rate.
        return max(0.0, (need - self.mine(since_sync_s, routers)) * routers * 60.0 / self.per_minute)


@dataclass(slots=True)
class SharedTenant:
    requests: Share | None
    tokens: Share | None
    routers: int  # routers its level is divided among until the next sync (>= 1)
    synced_at: float  # when the levels were learned (the limiter's clock)
    used_at: float  # last admission or settle here; -inf when only learned from the fleet
    demand: bool = False  # asked here since the last sync
    warm_syncs: int = 0  # consecutive syncs with demand here

    def unpublished(self) -> bool:
        return any(s is not None and s.unpublished != 0 for s in (self.requests, self.tokens))


@dataclass(slots=True)
class Sent:
    tenant: str
    state: SharedTenant
    requests: float
    tokens: float
    demand: bool


def take_sent(name: str, state: SharedTenant) -> Sent:
    sent = Sent(name, state, _take_unpublished(state.requests), _take_unpublished(state.tokens),
                 state.demand)
    state.demand = False
    return sent


def _take_unpublished(share: Share | None) -> float:
    if share is None:
        return 0.0
    used, share.unpublished = share.unpublished, 0.0
    return used


def give_back(sent: Sent) -> None:
    if sent.state.requests is not None:
        sent.state.requests.unpublished += sent.requests
    if sent.state.tokens is not None:
        sent.state.tokens.unpublished += sent.tokens
    sent.state.demand |= sent.demand


def script_args(share: Share | None, used: float) -> tuple[float, float, float]:
    if share is None:
        return (0, 0, 0)
    return (share.per_minute, share.capacity, used)


def learn(state: SharedTenant, reply: list[Any], synced_at: float, routers: int) -> None:
    for share, level in ((state.requests, reply[0]), (state.tokens, reply[1])):
        # An empty level: the limit did not exist when the sync started (it was added since).
        if share is not None and level != "":
            share.level = min(share.capacity, float(level))
    state.routers = routers
    state.synced_at = synced_at


def learned_share(per_minute: str, level: str, burst_s: float) -> Share | None:
    if per_minute == "" or level == "":
        return None
    share = Share.provisional(round(float(per_minute)), burst_s)
    share.level = min(share.capacity, float(level))
    return share


def shared_headers(state: SharedTenant, since_s: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, share in (("requests", state.requests), ("tokens", state.tokens)):
        if share is not None:
            left = share.fleet_left(since_s)
            reset_s = max(0.0, (share.capacity - left) * 60.0 / share.per_minute)
            _add_headers(headers, kind, share.per_minute, left, reset_s)
    return headers
