"""What a request asks of flow control: its priority band and how long it may wait.

The band is the key's priority (its own override, else its tenant's: the routing table's
`TenantEntry.priority`); `x-meridian-priority` may lower it, never raise it: what a key
allows is the operator's decision, not the client's (a higher value is refused with 400,
so a client learns it at once rather than from a queue). A band below meridian.contracts.SHEDDABLE_BELOW (0) is sheddable.
`x-meridian-queue-ttl` (seconds) asks for a shorter or longer wait than the router's
default, up to its maximum (a longer ask is cut to the maximum).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from meridian.contracts import PRIORITY_MIN, TenantEntry
from meridian.settings.router import RouterSettings

from ..errors import BadRequest

HEADER_PRIORITY = "x-meridian-priority"
HEADER_QUEUE_TTL = "x-meridian-queue-ttl"


def band_of(tenant: TenantEntry, headers: Mapping[str, str]) -> int:
    """The request's band: the key's, or lower as the header asks."""
    allowed = tenant.priority
    asked = headers.get(HEADER_PRIORITY)
    if asked is None:
        return allowed
    try:
        band = int(asked.strip())
    except ValueError:
        raise BadRequest(f"{HEADER_PRIORITY} must be an integer from {PRIORITY_MIN} to {allowed}") from None
    if band > allowed:
        raise BadRequest(f"{HEADER_PRIORITY} {band} is above what this API key allows ({allowed})")
    if band < PRIORITY_MIN:
        raise BadRequest(f"{HEADER_PRIORITY} must be at least {PRIORITY_MIN}")
    return band


def ttl_of(settings: RouterSettings, headers: Mapping[str, str]) -> float:
    """How long the request may wait for room, in seconds."""
    asked = headers.get(HEADER_QUEUE_TTL)
    if asked is None:
        return settings.flow_queue_ttl_s
    try:
        ttl = float(asked.strip())
    except ValueError:
        ttl = math.nan
    if not math.isfinite(ttl) or ttl <= 0:
        raise BadRequest(f"{HEADER_QUEUE_TTL} must be a number of seconds above 0")
    return min(ttl, settings.flow_queue_max_ttl_s)
