"""Flow control: requests wait at the router, in a fair order, when a zone's replicas are full.

Rate limits cap what one tenant may send; they do nothing when the fleet as a whole is full,
and then every node's own queue fills in arrival order: one tenant's burst of long prompts
raises everyone's time to first token. So the router holds the backlog instead, per
(residency zone, model) pool, and lets a request go only while the pool has room; which
request goes next is geo_router.admission.flow_queue's decision (priority bands, then the
tenant that has received the least weighted work, then first come first served).

**Room.** A pool's slots are the batch slots of its replicas (each node's `max_num_seqs` as
it registered it; `flow_default_slots` for a node that did not say), counted over the
replicas the zone's tenants may use and that are not ejected. Its occupancy is this router's
own requests let go and not finished (exact, at once) plus what other routers have there:
each node's last reported running + waiting less this router's own in flight there when the
page was read (the prober's scrape, about once a second; geo_router.admission.flow_capacity). A pool is full at
its slots less a reserve, which only a light tenant may use: one whose requests running and
waiting are fewer than slots / (tenants active in the pool + 1). A light tenant's request
beside a flood starts at once, in the batch, instead of waiting for a flooding tenant's
request to end; a backlogged tenant is never light, so the reserve never reorders backlogged
tenants. So node queues stay empty: the router, not the node, holds the backlog.

**The reserve** is `flow_reserve_share` of the slots, or, when light tenants have lately had
more requests at once (`LightPeak`: the most, running and waiting, over the last one to two
`flow_reserve_window_s`), that many, up to half the slots; and the light tenants' requests
running count against it, not against the slots below it. A fixed reserve was too small
beside a flood: a light tenant with three requests at once (bench.flow_control's B: three
users, a short think time) against a reserve of two lost the reserve's slots to the flood
whenever it paused, and its third request waited for one of the flood's to end (held p90
100-260 ms on a slower box; half of its requests waited in a simulation of it, 3% with
the reserve of two counted as before, none sized by its demand: the unit tests). Sized by
their demand, a light tenant's next request finds a slot unless it asks for more than it
lately did, and the flood fills everything else: the slots idle are what the light tenants
are not using at the moment.

**Work-conserving.** A request that finds room and nobody waiting goes at once (`admit_now`:
no task, no timer, no future; the pool's capacity is measured at most every 50 ms). A
pool with no slots (scaled to zero, every replica ejected) is not held here: the rest of the
pipeline answers it (scale-from-zero's hold, or a 503 with Retry-After).

**Work.** A request's work is estimated at arrival (prompt characters / 4 plus the tokens it may
generate) and corrected by its answer's usage when it ends. An estimate that is wrong the same
way for every request of a tenant (a tokenizer of 1.7 characters a token; answers that stop
well before max_tokens) would skew the order for as long as its requests run, so each
tenant's estimates are scaled by what its answers turned out to be (`calibrated`).

**Deadlines.** A waiting request has a queue TTL (`flow_queue_ttl_s`, or the request's
`x-meridian-queue-ttl` up to `flow_queue_max_ttl_s`); past it, 503 queue_timeout with
Retry-After. A client that leaves takes its place out of the queue. A request let go is
never taken back: streams already running are never preempted.

**Several routers.** Were each router to fill all the room it saw free, several routers
would each fill the same room. Seen through the nodes' reports (at most a probe interval
stale, and noisy: geo_router.admission.flow_peers) the pool swung between overfull and
underfull every interval, and a light tenant's request waited out the swing
(bench.flow_control, two routers: B's TTFT p90 1.57 s, 1.55 s of it held here). With Redis,
each router publishes its requests running and its demand (running + waiting) per pool every
0.1 s (geo_router.admission.flow_peers), and the slots below the reserve are split between
the routers max-min fairly by demand (`Peers.quota`: a router asking less than an equal
share gets what it asks, the others split the rest equally, rounded down): while other
routers have requests waiting, a router lets requests go only below its own quota, which no
other router's momentary count moves, so two routers never fill the same hole; room no other
router waits for is anyone's (work-conserving). (In proportion to demand, two backlogged
routers' quotas moved with their queues' lengths and, read at different moments, summed to
one more than the slots half the time: the reserve went to the flood.) The reserve is
counted by what is in use (every router's running as published): a light tenant's request
goes in beside any router's flood. Without Redis (or while the published view is stale) a
router counts the others from the nodes' reports and fills what it sees free. The work
counters are shared through Redis as well (geo_router.admission.flow_counters).

**Seen by the autoscaler.** The backlog held here is on no node's report, so each router
tells the control plane what it holds (geo_router.admission.flow_report), and the
autoscaler counts it with the nodes' running and waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from meridian.clock import Clock, first_or_timeout
from meridian.contracts import SHEDDABLE_BELOW
from meridian.settings.router import RouterSettings

from ..errors import QueueFull, QueueTimeout
from .flow_queue import Entry, FlowCaps, FlowQueue, LocalCounters, WorkCounters

# How far one answer moves a tenant's estimate correction (an exponential average).
_CALIBRATION_STEP = 0.2
_MAX_CALIBRATIONS = 100_000
# (residency zone, base model): requests that compete for the same replicas' batches.
PoolKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Peers:
    """The other routers of a pool as they published themselves (through Redis): the sum of
    their requests running, each one's demand (running + waiting), and this router's own
    demand as it published it."""

    others: int
    others_demand: tuple[int, ...]
    own_demand: int

    @property
    def others_waiting(self) -> int:
        return sum(self.others_demand) - self.others

    def quota(self, slots: int) -> int:
        """This router's max-min fair part of `slots` by demand: a router asking for less
        than an equal share of what is left gets what it asks; the rest share equally,
        rounded down (several routers may leave a slot or so unused, never one too many)."""
        left, routers = slots, 1 + len(self.others_demand)
        for demand in sorted(self.others_demand):
            if demand * routers >= left:
                break
            left, routers = left - demand, routers - 1
        return min(self.own_demand, left // routers)


@dataclass(frozen=True, slots=True)
class Capacity:
    """A pool's replicas as flow control counts them: their batch slots, the requests other
    routers have there, and, when the routers publish themselves (Redis), what they published
    (None: not known; this router then fills whatever it sees free)."""

    slots: int
    others: int = 0
    peers: Peers | None = None


@dataclass(frozen=True, slots=True)
class Room:
    """What the gate decides on: the pool's slots, its reserve, what is in it now (`in_use`:
    this router's requests and the others'), and what counts against the slots below the
    reserve (`occupied`: the same, or with peers, this router's requests plus the slots that
    are the other routers' quotas)."""

    slots: int
    reserve: int
    occupied: int
    in_use: int | None = None

    @staticmethod
    def of(capacity: Capacity, running: int, reserve: int, light: int = 0) -> Room:
        """The room as this router sees it with `running` of its requests let go, `light` of
        them light tenants' (they count against the reserve, not the slots below it; module
        doc, The reserve and Several routers): below the reserve, room no other router waits
        for, or its quota."""
        in_use = running + capacity.others
        if capacity.peers is None:
            return Room(capacity.slots, reserve, in_use - light, in_use)
        below = capacity.slots - reserve
        # Room no other router waits for is anyone's (work-conserving: a burst does not wait
        # for the next sync to raise this router's demand); room they wait for goes by quota.
        unclaimed = in_use + capacity.peers.others_waiting
        occupied = min(unclaimed, running + below - capacity.peers.quota(below))
        return Room(capacity.slots, reserve, occupied - light, in_use)

    def admits(self, light: bool) -> bool:
        """Whether one more request fits: below the slots less the reserve (with peers, below
        this router's quota), or into the reserve for a light tenant's, by what is in use (a
        light tenant's request goes in beside any router's flood)."""
        if self.occupied < self.slots - self.reserve:
            return True
        in_use = self.occupied if self.in_use is None else self.in_use
        return light and in_use < self.slots


def reserve_of(slots: int, share: float, light_peak: int = 0) -> int:
    """The slots kept for tenants below their fair share: `share` of them (rounded down), or,
    while light tenants come, as many as they lately had at once (`light_peak`), up to half
    the slots (module doc, The reserve). A share of 0 keeps none; a small pool whose share
    rounds to none keeps room for its light tenants alone (with 8 slots and the default
    share, a flood otherwise took every slot and each light request waited for one of the
    flood's to end: 0.5 s at p90 on two CPU cores)."""
    if share <= 0:
        return 0
    return max(math.floor(slots * share), min(light_peak, slots // 2))


@dataclass(slots=True)
class LightPeak:
    """The most requests (running and waiting) a pool's light tenants had at once, over the
    last one to two windows: a maximum kept in two buckets, so that a light tenant pausing
    between its requests does not shrink the reserve the moment it pauses, and one that has
    gone gives it back within two windows."""

    window_s: float
    current: int = 0
    previous: int = 0
    bucket_ends: float = -math.inf

    def observe(self, demand: int, now: float) -> None:
        self._roll(now)
        self.current = max(self.current, demand)

    def peak(self, now: float) -> int:
        self._roll(now)
        return max(self.current, self.previous)

    @property
    def seen(self) -> bool:
        """Whether any light demand is kept at all (a pool that never had a light tenant's
        request waiting reads no clock for its reserve)."""
        return bool(self.current or self.previous)

    def _roll(self, now: float) -> None:
        if now < self.bucket_ends:
            return
        # A bucket ended: it becomes the previous one, unless a whole window passed since.
        self.previous = self.current if now < self.bucket_ends + self.window_s else 0
        self.current = 0
        self.bucket_ends = now + self.window_s


def below_fair_share(demand: int, slots: int, tenants: int) -> bool:
    """Whether a tenant with `demand` requests (running and waiting) in a pool of `slots`
    shared by `tenants` active tenants (itself included) asks for less than an equal share
    were one more tenant to come: the reserve is for arrivals beside a flood, so a tenant
    alone in the pool does not take it."""
    return demand < slots / (max(1, tenants) + 1)


def calibrated(ratio: float, estimate: float, actual: float) -> float:
    """A tenant's estimate correction after one answer: moved a fifth of the way to what
    would have made this answer's uncorrected `estimate` exact (actual / estimate), within
    1/8 to 8 (one odd answer moves it little). Measured against the uncorrected estimate, not
    the corrected one the request went with: a tenant's requests in flight all went with the
    correction of their time, and scaling the correction by each of their errors in turn
    compounds (sixteen answers at three times the estimate took it to 8, then sixteen at
    8/3 of the new estimate back down: the charges swung by thousands of tokens a second)."""
    return min(8.0, max(0.125, ratio + _CALIBRATION_STEP * (actual / estimate - ratio)))


@dataclass(slots=True)
class FlowGauges:
    """Requests waiting per (zone, model, band, tenant); per pool, the requests this router let
    go and that have not finished, its slots, other routers' requests there, and its reserve."""

    waiting: dict[tuple[str, str, int, str], int] = field(default_factory=dict)
    pools: dict[PoolKey, tuple[int, int, int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class FlowRequest:
    """One request as flow control sees it."""

    pool: PoolKey
    tenant: str
    band: int
    weight: float
    work: float  # estimated tokens: prompt + what it may generate
    size: int  # request bytes
    ttl_s: float


@dataclass(slots=True)
class _Pool:
    # Its waiting requests, and those this router let go and that have not finished (the
    # queue's `running`: charged when they go, settled when they end).
    queue: FlowQueue[asyncio.Future[bool]]
    # The most requests its light tenants had at once lately: what sizes the reserve.
    light: LightPeak


@dataclass(slots=True, eq=False)
class Ticket:
    """A request let go: release it once its answer has ended (`actual_work`: the tokens it
    really was, None when not known), exactly once."""

    control: FlowControl | None
    pool: PoolKey
    entry: Entry[asyncio.Future[bool]] | None
    estimate: float = 0.0  # the request's work as estimated, before its tenant's correction
    waited_s: float = 0.0
    released: bool = False

    def release(self, actual_work: float | None = None) -> None:
        if self.released or self.control is None or self.entry is None:
            return
        self.released = True
        self.control._release(self, actual_work)


def unheld(pool: PoolKey) -> Ticket:
    """A ticket for a request flow control does not hold (off, a route it does not hold, no slots)."""
    return Ticket(None, pool, None)


class FlowControl:
    """The router's pools: `admit` waits for room, `Ticket.release` makes it (module doc)."""

    def __init__(
        self,
        settings: RouterSettings,
        capacity: Callable[[PoolKey], Capacity],
        clock: Clock,
        counters: Callable[[PoolKey], WorkCounters] | None = None,
    ) -> None:
        self._settings = settings
        self._capacity = capacity
        self._clock = clock
        self._counters = counters or (lambda _pool: LocalCounters())
        self._caps = FlowCaps(settings.flow_queue_max_entries, settings.flow_queue_max_bytes)
        self._pools: dict[PoolKey, _Pool] = {}
        self._ticker: asyncio.Task[None] | None = None
        # Set while requests wait (the ticker runs): what the backlog report waits on.
        self._backlogged = asyncio.Event()
        self._passed_future: asyncio.Future[bool] | None = None
        # Per (pool, tenant), what its answers' work turned out to be over the estimate.
        self._calibration: dict[tuple[PoolKey, str], float] = {}

    @property
    def enabled(self) -> bool:
        return self._settings.flow_control

    def pools(self) -> dict[PoolKey, _Pool]:
        return self._pools

    def admit_now(self, request: FlowRequest) -> Ticket | None:
        """A ticket at once when the request may go without waiting (flow control off, a pool
        without slots, nobody waiting and room); None when it must wait (`admit`). The
        request path's only cost on an unsaturated fleet: no task, no timer, no future."""
        if not self._settings.flow_control:
            return unheld(request.pool)
        capacity = self._capacity(request.pool)
        if capacity.slots <= 0:
            return unheld(request.pool)
        pool = self._pool(request.pool)
        if len(pool.queue):
            return None
        room = self._room(pool, capacity)
        if not (room.admits(False) or room.admits(self._light(pool, request.tenant, capacity, 1))):
            return None
        entry = self._entry(request, self._passed())
        pool.queue.charge(entry)  # nobody waits: no order to keep
        return Ticket(self, request.pool, entry, request.work)

    async def admit(self, request: FlowRequest) -> Ticket:
        """A ticket once the request may go; QueueFull or QueueTimeout when it may not."""
        ticket = self.admit_now(request)
        if ticket is not None:
            return ticket
        pool, capacity = self._pool(request.pool), self._capacity(request.pool)
        entry = self._entry(request, asyncio.get_running_loop().create_future())
        refusal, shed = pool.queue.push(entry)
        for victim in shed:
            victim.item.set_exception(QueueFull(request.pool[1], self._retry_after_s(), shed=True))
        if refusal is not None:
            raise QueueFull(request.pool[1], self._retry_after_s())
        pool.light.observe(self._light_load(pool, capacity)[1], self._clock.monotonic())
        self._pump(request.pool, pool, capacity)  # it may be next, and fit
        if not entry.item.done():
            self._ticking()
        return await self._wait(request, pool, entry)

    def _entry(self, request: FlowRequest, item: asyncio.Future[bool]) -> Entry[asyncio.Future[bool]]:
        work = request.work * self._calibration.get((request.pool, request.tenant), 1.0)
        return Entry(item, request.tenant, request.band, work, request.size, self._clock.monotonic() + request.ttl_s,
                     request.weight, sheddable=request.band < SHEDDABLE_BELOW)

    def pump(self, key: PoolKey) -> None:
        """Let waiting requests of `key` go while the pool has room (and expire the late)."""
        pool = self._pools.get(key)
        if pool is None or not len(pool.queue):
            return  # nobody waits (an unsaturated pool's every release): nothing to read
        now = self._clock.monotonic()
        for late in pool.queue.expired(now):
            if not late.item.done():
                late.item.set_result(False)  # past its deadline: the waiter answers 503
        self._pump(key, pool, self._capacity(key))

    def gauges(self) -> FlowGauges:
        """What the metrics show, read at scrape time (FlowGauges)."""
        gauges = FlowGauges()
        for key, pool in self._pools.items():
            for (band, tenant), n in pool.queue.waiting().items():
                gauges.waiting[(*key, band, tenant)] = n
            capacity = self._capacity(key)
            reserve = self._room(pool, capacity).reserve
            gauges.pools[key] = (pool.queue.running, capacity.slots, capacity.others, reserve)
        return gauges

    def held(self) -> dict[PoolKey, int]:
        """Requests waiting per pool now (what the backlog report tells the control plane)."""
        return {key: n for key, pool in self._pools.items() if (n := len(pool.queue))}

    def active_pools(self) -> dict[PoolKey, tuple[int, int]]:
        """Per pool where this router has requests let go (and not finished) or waiting: how
        many of each (what it publishes to the other routers)."""
        return {key: (pool.queue.running, len(pool.queue)) for key, pool in self._pools.items()
                if pool.queue.running or len(pool.queue)}

    def pump_all(self) -> None:
        """Every pool with requests waiting: room may have come from elsewhere (a new node,
        other routers' requests ending), which no release of this router's announces."""
        for key in [k for k, p in self._pools.items() if len(p.queue)]:
            self.pump(key)

    async def aclose(self) -> None:
        """Stop the pumping (the app's lifespan, on the way out)."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    async def _tick(self) -> None:
        """Pump every pool once per probe interval while requests wait, as the nodes' reports
        refresh (nothing wakes while nothing waits)."""
        while any(len(p.queue) for p in self._pools.values()):
            await self._clock.sleep(self._settings.probe_interval_s)
            self.pump_all()
        self._ticker = None
        self._backlogged.clear()

    def _ticking(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="flow-control")
            self._backlogged.set()

    async def backlogged(self) -> None:
        """Return once requests wait (at once if they do now): an idle router's backlog report
        sleeps here, on no timer."""
        await self._backlogged.wait()

    # --- internals -------------------------------------------------------------------------

    def _passed(self) -> asyncio.Future[bool]:
        """The one settled future of the requests that never wait (a future each cost every
        request a loop call; an entry that waits gets its own)."""
        if self._passed_future is None:
            self._passed_future = asyncio.get_running_loop().create_future()
            self._passed_future.set_result(True)
        return self._passed_future

    def _pool(self, key: PoolKey) -> _Pool:
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(FlowQueue(self._caps, self._counters(key)),
                                            LightPeak(self._settings.flow_reserve_window_s))
        return pool

    def _pump(self, key: PoolKey, pool: _Pool, capacity: Capacity) -> None:
        """Let entries go in the queue's order while the pool is below its slots less the
        reserve; then into the reserve, in the same order among the light tenants (the
        reserve is theirs: a flood's next request, which may not use it, does not block it)."""
        while (entry := pool.queue.peek()) is not None and self._room(pool, capacity).admits(False):
            self._dispatch(key, pool, entry)
        while self._room(pool, capacity).admits(True):
            entry = pool.queue.peek(lambda tenant: self._light(pool, tenant, capacity))
            if entry is None:
                return
            self._dispatch(key, pool, entry)

    def _dispatch(self, key: PoolKey, pool: _Pool, entry: Entry[asyncio.Future[bool]]) -> None:
        pool.queue.take(entry)
        entry.item.set_result(True)

    def _room(self, pool: _Pool, capacity: Capacity) -> Room:
        """The room, the light tenants' requests running counted against the reserve. The
        reserve is their recent peak only while a light tenant has requests here: a backlogged
        tenant whose queue emptied for a moment was light then, and its peak, kept from the
        backlogged tenants for a window, left a quarter of the slots idle and turned weights
        of 2:1:1 into 1:2:3 (bench.flow_control's weighted run). Their count (a pass over the
        pool's tenants) is made only when the pool is past its slots less that reserve: an
        unsaturated pool's requests never pay for it."""
        share = self._settings.flow_reserve_share
        peak = pool.light.peak(self._clock.monotonic()) if share and pool.light.seen else 0
        reserve = reserve_of(capacity.slots, share, peak)
        room = Room.of(capacity, pool.queue.running, reserve)
        if not peak or room.admits(False):
            return room
        light_running, light_demand = self._light_load(pool, capacity)
        if not light_demand:
            return Room.of(capacity, pool.queue.running, reserve_of(capacity.slots, share))
        return Room.of(capacity, pool.queue.running, reserve, light_running)

    def _light(self, pool: _Pool, tenant: str, capacity: Capacity, arriving: int = 0) -> bool:
        """Whether `tenant` asks for less than a fair share of the pool: its requests running
        and waiting here (and `arriving`, one not yet queued) are fewer than the slots shared
        by the active tenants and one more. A backlogged tenant is never light, so the reserve
        never reorders backlogged tenants: their shares stay the counters' (the weights),
        however short their requests."""
        tenants = len(pool.queue.running_tenants() | pool.queue.tenants() | {tenant})
        demand = pool.queue.running_of(tenant) + pool.queue.waiting_of(tenant) + arriving
        return below_fair_share(demand, capacity.slots, tenants)

    def _light_load(self, pool: _Pool, capacity: Capacity) -> tuple[int, int]:
        """The light tenants' requests running here, and running and waiting."""
        queue = pool.queue
        tenants = queue.running_tenants() | queue.tenants()
        running = demand = 0
        for tenant in tenants:
            mine = queue.running_of(tenant)
            total = mine + queue.waiting_of(tenant)
            if below_fair_share(total, capacity.slots, len(tenants)):
                running, demand = running + mine, demand + total
        return running, demand

    async def _wait(self, request: FlowRequest, pool: _Pool, entry: Entry[asyncio.Future[bool]]) -> Ticket:
        """Until `pump` lets the entry go (True), finds it late (False) or sheds it (QueueFull).
        A cancel (the caller's client left: its watch cancels the task) takes it out of the
        queue, or gives back the slot it was just given."""
        started = self._clock.monotonic()
        try:
            while not entry.item.done():
                remaining = entry.expires_at - self._clock.monotonic()
                if remaining <= 0:
                    pool.queue.discard(entry)
                    entry.item.set_result(False)
                    break
                await first_or_timeout(self._clock, remaining, entry.item)
        except BaseException:
            if entry.item.done() and not entry.item.cancelled() and entry.item.exception() is None \
                    and entry.item.result():
                self._release_entry(request.pool, entry, 0.0, request.work)
            else:
                pool.queue.discard(entry)
                entry.item.cancel()
            raise
        if not entry.item.result():  # raises QueueFull when it was shed
            raise QueueTimeout(request.pool[1], request.ttl_s, self._retry_after_s())
        return Ticket(self, request.pool, entry, request.work, waited_s=self._clock.monotonic() - started)

    def _release(self, ticket: Ticket, actual_work: float | None) -> None:
        assert ticket.entry is not None
        self._release_entry(ticket.pool, ticket.entry, actual_work, ticket.estimate)

    def _release_entry(self, key: PoolKey, entry: Entry[asyncio.Future[bool]], actual_work: float | None,
                       estimate: float) -> None:
        pool = self._pools.get(key)
        if pool is None:
            return
        pool.queue.settle(entry, actual_work)
        if actual_work is not None and actual_work > 0 and estimate > 0:
            self._calibrate((key, entry.tenant), estimate, actual_work)
        self.pump(key)

    def _calibrate(self, key: tuple[PoolKey, str], estimate: float, actual: float) -> None:
        """A tenant's correction in a pool, kept while its pool comes and goes (bounded: tenants
        and models come and go too)."""
        if key not in self._calibration and len(self._calibration) >= _MAX_CALIBRATIONS:
            self._calibration.clear()
        self._calibration[key] = calibrated(self._calibration.get(key, 1.0), estimate, actual)

    def _retry_after_s(self) -> int:
        return max(1, math.ceil(self._settings.probe_interval_s))
