"""Flow control's queue: which waiting request goes next when the fleet has room (issue 37).

Pure on purpose: no I/O, no clock reads (the caller passes `now`), no tasks. The admission
stage wraps one `FlowQueue` per (residency zone, model) with the waiting and the waking, and
the saturation signal says when there is room; what is decided here is only the order, the
deadlines and whom to shed.

The order of dispatch:

1. **Priority bands**, the highest first (an int: larger is more urgent). A lower band gets
   nothing while a higher one waits: that is what a band is for; the deadlines bound how long
   a lower band can starve.
2. Within a band, **the tenant that has received the least weighted work**: a virtual token
   counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). A tenant's
   counter grows by the work it was served divided by its weight, work being prompt tokens
   plus generated tokens (an estimate at dispatch, corrected by `settle` with the answer's
   usage), so a tenant of long prompts gets fewer requests, not more tokens. A tenant that
   starts to wait comes back at the least counter of the tenants waiting in its band (none
   waiting: the counter of the tenant served last): idle time is not credit to spend later in
   a burst (the paper's "lift"). The lift leaves a tenant the work of its requests still
   running: that was charged in full when they went (the paper charges tokens as they are
   generated), so without the allowance a tenant whose flow empties for a moment between its
   requests (a client that sends its next request when the last ends leaves a gap at every
   turn) would pay for them twice, in the charge and in the lift, and lose the lead its weight
   earned. The allowance is bounded by what it has running: never credit saved while idle.
3. **First come, first served** within a tenant's flow. Between tenants level on their counters
   (one just lifted), the one that started to wait last goes first.

Deadlines: every entry carries `expires_at`; `expired(now)` takes out those past it (the
caller answers them 503 with Retry-After). Shedding: when an arrival finds the queue at its
count or byte cap, the newest entries of the lowest sheddable band go to make room (a newer
entry of a less urgent band is worth least); with not enough sheddable below the arrival's
band, the arrival itself is refused and nothing is shed. Nothing running is ever touched: the queue holds only requests
not yet sent.

Counters are kept per tenant across the queue's bands (a tenant's work is its work whatever
band it came in): in `WorkCounters`, which a router shares with its siblings and other
routers (Redis, as rate limits are) so that spreading requests over routers gains nothing.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Refusal(StrEnum):
    """Why an arrival did not get a place in the queue."""

    FULL = "queue_full"  # at its caps, with nothing less urgent to shed


class WorkCounters(Protocol):
    """Each tenant's weighted work served (the virtual token counters), possibly shared."""

    def level(self, tenant: str) -> float: ...

    def charge(self, tenant: str, weighted_work: float) -> None:
        """Add to the tenant's counter (negative: give back an over-estimate)."""
        ...

    def lift(self, tenant: str, floor: float) -> None:
        """Raise the tenant's counter to at least `floor`."""
        ...


class LocalCounters:
    """WorkCounters in this process's memory (one router, one worker)."""

    def __init__(self) -> None:
        self._levels: dict[str, float] = {}

    def level(self, tenant: str) -> float:
        return self._levels.get(tenant, 0.0)

    def charge(self, tenant: str, weighted_work: float) -> None:
        self._levels[tenant] = self._levels.get(tenant, 0.0) + weighted_work

    def lift(self, tenant: str, floor: float) -> None:
        if self._levels.get(tenant, 0.0) < floor:
            self._levels[tenant] = floor


@dataclass(frozen=True, slots=True)
class FlowCaps:
    """How much one queue holds: entries and request bytes."""

    max_entries: int
    max_bytes: int


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """A waiting request: its tenant, band, estimated work and deadline, and the caller's item."""

    item: T
    tenant: str
    band: int
    work: float  # estimated tokens: prompt + what it may generate
    size: int  # request bytes, counted against the byte cap
    expires_at: float
    weight: float = 1.0
    sheddable: bool = False
    seq: int = 0  # arrival order, set by the queue


@dataclass(slots=True)
class _Running:
    """One tenant's requests dispatched and not yet settled: how many, and their weighted work."""

    requests: int = 0
    work: float = 0.0


@dataclass(slots=True)
class _Band(Generic[T]):
    flows: dict[str, deque[Entry[T]]] = field(default_factory=dict)
    # When each tenant's flow started to wait (the arrival order of its first entry).
    since: dict[str, int] = field(default_factory=dict)


class FlowQueue(Generic[T]):
    """The waiting requests of one (zone, model), in dispatch order (the module docstring)."""

    def __init__(self, caps: FlowCaps, counters: WorkCounters | None = None) -> None:
        self._caps = caps
        self._counters: WorkCounters = counters if counters is not None else LocalCounters()
        self._bands: dict[int, _Band[T]] = {}
        self._seq = itertools.count()
        self._last_served: str | None = None
        # Per tenant, its requests dispatched and not yet settled: their work is what the lift
        # leaves it (the module docstring), their number what the caller's fair share counts.
        self._running: dict[str, _Running] = {}
        self.entries = 0
        self.bytes = 0
        self.running = 0  # requests dispatched and not yet settled, of every tenant

    def __len__(self) -> int:
        return self.entries

    def push(self, entry: Entry[T]) -> tuple[Refusal | None, list[Entry[T]]]:
        """Queue `entry`; returns why it was refused (None: queued) and the entries shed for it."""
        victims = self._victims_for(entry)
        if victims is None:
            return Refusal.FULL, []
        for victim in victims:
            self._remove(victim)
        entry.seq = next(self._seq)
        band = self._bands.setdefault(entry.band, _Band())
        if entry.tenant not in band.flows:
            self._lift(band, entry.tenant)
        self._append(entry)
        return None, victims

    def peek(self, only: Callable[[str], bool] | None = None) -> Entry[T] | None:
        """The entry `pop` would take next (None when empty), left in place and uncharged;
        with `only`, the next of the most urgent band's tenants that `only` admits."""
        if not self._bands:
            return None
        band = self._bands[max(self._bands)]
        tenants = [t for t in band.flows if only(t)] if only is not None else band.flows
        if not tenants:
            return None
        # Between tenants level on their counters (one just lifted to the least), the one
        # that started to wait last goes first: a light tenant's request beside a flood waits
        # for no one's turn; its counter is then charged, and the flood's turn comes.
        tenant = min(tenants, key=lambda t: (self._counters.level(t), -band.since[t], band.flows[t][0].seq))
        return band.flows[tenant][0]

    def tenants(self) -> set[str]:
        """The tenants with entries waiting, in any band."""
        return {t for band in self._bands.values() for t in band.flows}

    def waiting_of(self, tenant: str) -> int:
        """The tenant's entries waiting, in every band."""
        return sum(len(band.flows.get(tenant, ())) for band in self._bands.values())

    def pop(self) -> Entry[T] | None:
        """The next entry to dispatch (None when empty); its tenant is charged its estimate."""
        entry = self.peek()
        if entry is not None:
            self.take(entry)
        return entry

    def take(self, entry: Entry[T]) -> None:
        """Dispatch a queued entry (one `peek` chose): out of the queue, its tenant charged."""
        self._remove(entry)
        self.charge(entry)

    def charge(self, entry: Entry[T]) -> None:
        """Charge a request that went without waiting (pop charges those that waited); it runs
        until `settle`."""
        weighted = entry.work / entry.weight
        self._counters.charge(entry.tenant, weighted)
        running = self._running.setdefault(entry.tenant, _Running())
        running.requests += 1
        running.work += weighted
        self.running += 1
        self._last_served = entry.tenant

    def discard(self, entry: Entry[T]) -> bool:
        """Take `entry` out unserved (its client left); False when it is no longer queued."""
        band = self._bands.get(entry.band)
        flow = band.flows.get(entry.tenant) if band is not None else None
        if flow is None or entry not in flow:
            return False
        self._remove(entry)
        return True

    def top_band(self) -> int | None:
        """The most urgent band waiting (None: nothing waits)."""
        return max(self._bands) if self._bands else None

    def waiting(self) -> dict[tuple[int, str], int]:
        """Entries waiting per (band, tenant): what the queue-depth gauges show."""
        return {(level, t): len(flow) for level, band in self._bands.items() for t, flow in band.flows.items()}

    def settle(self, entry: Entry[T], actual_work: float | None) -> None:
        """A dispatched entry has ended: it no longer runs, and its tenant's charge is corrected
        with the work the answer really was (None: not known, the estimate stands)."""
        running = self._running.get(entry.tenant)
        if running is not None:
            running.requests -= 1
            running.work -= entry.work / entry.weight
            self.running -= 1
            if running.requests <= 0:
                del self._running[entry.tenant]
        if actual_work is not None:
            self._counters.charge(entry.tenant, (actual_work - entry.work) / entry.weight)

    def running_work(self, tenant: str) -> float:
        """The weighted work of the tenant's entries dispatched and not yet settled."""
        running = self._running.get(tenant)
        return running.work if running is not None else 0.0

    def running_of(self, tenant: str) -> int:
        """The tenant's entries dispatched and not yet settled."""
        running = self._running.get(tenant)
        return running.requests if running is not None else 0

    def running_tenants(self) -> set[str]:
        """The tenants with entries dispatched and not yet settled."""
        return set(self._running)

    def expired(self, now: float) -> list[Entry[T]]:
        """Take out and return the entries past their deadline, oldest first."""
        late = [e for e in self._all() if e.expires_at <= now]
        for e in late:
            self._remove(e)
        return sorted(late, key=lambda e: e.seq)

    def next_deadline(self) -> float | None:
        return min((e.expires_at for e in self._all()), default=None)

    # --- internals -------------------------------------------------------------------------

    def _all(self) -> Iterable[Entry[T]]:
        for band in self._bands.values():
            for flow in band.flows.values():
                yield from flow

    def _victims_for(self, arrival: Entry[T]) -> list[Entry[T]] | None:
        """What must be shed for `arrival` to fit ([] when it fits as is; None: it cannot).
        Only sheddable entries of bands below the arrival's, the lowest band first and the
        newest of it first."""
        caps = self._caps
        if arrival.size > caps.max_bytes:
            return None
        entries, size = self.entries + 1, self.bytes + arrival.size
        victims: list[Entry[T]] = []
        for level in sorted(self._bands):
            if entries <= caps.max_entries and size <= caps.max_bytes:
                break
            if level >= arrival.band:
                return None
            sheddable = [e for flow in self._bands[level].flows.values() for e in flow if e.sheddable]
            for e in sorted(sheddable, key=lambda e: e.seq, reverse=True):
                if entries <= caps.max_entries and size <= caps.max_bytes:
                    break
                victims.append(e)
                entries, size = entries - 1, size - e.size
        return victims if entries <= caps.max_entries and size <= caps.max_bytes else None

    def _lift(self, band: _Band[T], tenant: str) -> None:
        """A tenant that starts to wait in `band` starts from the least counter of those waiting
        there, or with none waiting, from the counter of the tenant served last, less the work
        it has running (charged up front, not yet served)."""
        if band.flows:
            floor = min(self._counters.level(t) for t in band.flows)
        elif self._last_served is not None:
            floor = self._counters.level(self._last_served)
        else:
            return
        self._counters.lift(tenant, floor - self.running_work(tenant))

    def _append(self, entry: Entry[T]) -> None:
        band = self._bands.setdefault(entry.band, _Band())
        if entry.tenant not in band.flows:
            band.flows[entry.tenant] = deque()
            band.since[entry.tenant] = entry.seq
        band.flows[entry.tenant].append(entry)
        self.entries += 1
        self.bytes += entry.size

    def _remove(self, entry: Entry[T]) -> None:
        band = self._bands[entry.band]
        flow = band.flows[entry.tenant]
        flow.remove(entry)
        if not flow:
            del band.flows[entry.tenant]
            del band.since[entry.tenant]
            if not band.flows:
                del self._bands[entry.band]
        self.entries -= 1
        self.bytes -= entry.size
