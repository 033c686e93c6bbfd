"""What the rate-limit tests share, in-process and on Redis: a limited tenant, and how many
requests a limiter admits back to back."""

from __future__ import annotations

from geo_router.admission.ratelimit import RateLimiter
from geo_router.errors import RateLimited
from meridian.contracts import TenantEntry


def tenant(rpm: int | None = None, tpm: int | None = None, *, name: str = "acme", key: str = "a") -> TenantEntry:
    return TenantEntry(key_hash=key * 64, key_prefix="mrd_" + key, tenant=name, zone="global",
                       requests_per_minute=rpm, tokens_per_minute=tpm)


def admitted(limiter: RateLimiter, t: TenantEntry, tokens: int = 0, *, upto: int = 10_000) -> int:
    """How many requests of `tokens` each are admitted back to back, right now (until the first refusal)."""
    for n in range(upto):
        try:
            limiter.admit(t, tokens)
        except RateLimited:
            return n
    return upto
