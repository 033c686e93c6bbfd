"""Flow control's pools: nothing waits while there is room, a full pool holds requests and lets
them go in fair order as room comes back, the reserve lets a light tenant in beside a flood,
deadlines answer 503 with Retry-After, a cancelled waiter leaves no trace, shedding takes the
less urgent first. Time is the ManualClock's."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from pydantic import SecretStr

from geo_router.admission.flow_control import (
    Capacity,
    FlowControl,
    FlowRequest,
    Peers,
    PoolKey,
    Room,
    Ticket,
    calibrated,
)
from geo_router.errors import QueueFull, QueueTimeout
from meridian.clock import ManualClock
from meridian.settings.router import RouterSettings

POOL: PoolKey = ("eu", "tiny")


class Pool:
    """The capacity flow control reads: slots and other routers' requests, set by the test."""

    def __init__(self, slots: int, others: int = 0) -> None:
        self.slots, self.others = slots, others

    def __call__(self, key: PoolKey) -> Capacity:
        assert key == POOL
        return Capacity(self.slots, self.others)


def _control(pool: Pool, clock: ManualClock, **overrides: Any) -> FlowControl:
    values: dict[str, Any] = {"cluster_token": SecretStr("t"), "flow_reserve_share": 0.0, "flow_queue_ttl_s": 30.0,
                              **overrides}
    return FlowControl(RouterSettings(**values), pool, clock)


def _request(tenant: str, *, band: int = 0, work: float = 100, weight: float = 1.0, ttl_s: float = 30.0,
             size: int = 10) -> FlowRequest:
    return FlowRequest(POOL, tenant, band, weight, work, size, ttl_s)


def _state(control: FlowControl) -> tuple[dict[tuple[str, str, int, str], int], int]:
    """What waits, and how many requests the pool has let go (0: no pool)."""
    gauges = control.gauges()
    return gauges.waiting, gauges.pools[POOL][0] if POOL in gauges.pools else 0


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_room_admits_below_the_slots_less_the_reserve_and_into_the_reserve_only_below_fair_share() -> None:
    room = Room(slots=16, reserve=2, occupied=14)
    assert not room.admits(False)
    assert room.admits(True)
    assert not Room(slots=16, reserve=2, occupied=16).admits(True)
    assert Room(slots=16, reserve=2, occupied=13).admits(False)


async def test_nothing_waits_while_there_is_room() -> None:
    clock = ManualClock()
    control = _control(Pool(2), clock)
    first = await asyncio.wait_for(control.admit(_request("a")), 1)
    second = await asyncio.wait_for(control.admit(_request("b")), 1)
    assert first.waited_s == second.waited_s == 0.0
    assert _state(control) == ({}, 2)


async def test_a_full_pool_holds_the_next_request_until_one_ends() -> None:
    clock = ManualClock()
    control = _control(Pool(1), clock)
    running = await control.admit(_request("a"))
    waiter = asyncio.ensure_future(control.admit(_request("b")))
    await _settle()
    assert not waiter.done()
    assert control.gauges().waiting == {("eu", "tiny", 0, "b"): 1}
    clock.advance(2.5)
    running.release(150)
    ticket = await asyncio.wait_for(waiter, 1)
    assert ticket.waited_s == pytest.approx(2.5)
    assert _state(control) == ({}, 1)


async def test_other_routers_requests_count_against_the_slots() -> None:
    clock = ManualClock()
    pool = Pool(4, others=4)
    control = _control(pool, clock)
    waiter = asyncio.ensure_future(control.admit(_request("a")))
    await _settle()
    assert not waiter.done()
    pool.others = 3  # their requests end: seen at the next pump, a probe interval on
    await clock.settled()
    await clock.advance_async(0.5)
    assert not waiter.done()
    await clock.advance_async(0.5)
    await asyncio.wait_for(waiter, 1)
    await control.aclose()


async def test_room_goes_to_the_tenant_with_the_least_work_a_newcomer_first_then_in_arrival_order() -> None:
    clock = ManualClock()
    control = _control(Pool(1), clock)
    running = await control.admit(_request("flood", work=1000))
    order: list[str] = []

    async def wait(name: str, tenant: str) -> Ticket:
        ticket = await control.admit(_request(tenant, work=1000))
        order.append(name)
        return ticket

    tasks = [asyncio.ensure_future(wait(f"flood-{i}", "flood")) for i in range(3)]
    await _settle()
    tasks.append(asyncio.ensure_future(wait("light", "light")))
    await _settle()
    ticket = running
    for _ in range(4):
        ticket.release(1000)
        await _settle()
        done = [t for t in tasks if t.done()]
        ticket = done[-1].result() if done else ticket
        tasks = [t for t in tasks if not t.done()]
    # The light tenant came last and starts level with the flood (an idle tenant banks no
    # credit), ahead of it on the tie: it goes next, not after the flood's backlog.
    assert order == ["light", "flood-0", "flood-1", "flood-2"]


async def test_the_reserve_lets_a_tenant_below_its_fair_share_in_beside_a_flood() -> None:
    clock = ManualClock()
    control = _control(Pool(16), clock, flow_reserve_share=0.125)  # 2 slots kept
    flood = [await control.admit(_request("flood")) for _ in range(14)]
    held = asyncio.ensure_future(control.admit(_request("flood")))
    await _settle()
    assert not held.done()  # the flood stops at 16 - 2
    light = await asyncio.wait_for(control.admit(_request("light")), 1)
    assert light.waited_s == 0.0
    flood[0].release(100)
    await asyncio.wait_for(held, 1)  # the light request counts against the reserve, not the flood's 14
    more = await asyncio.wait_for(control.admit(_request("light")), 1)  # the reserve's other slot
    assert more.waited_s == 0.0
    third = asyncio.ensure_future(control.admit(_request("light")))
    await _settle()
    assert not third.done()  # all 16 taken
    light.release(10)
    await asyncio.wait_for(third, 1)
    assert _state(control) == ({}, 16)
    # The light tenant had three at once: the reserve is now that many (the gauge).
    assert control.gauges().pools[POOL][3] == 3


async def test_the_reserve_grows_to_what_light_tenants_ask_and_shrinks_when_they_have_none() -> None:
    clock = ManualClock()
    control = _control(Pool(16), clock, flow_reserve_share=0.125)  # 2 slots kept
    flood = [await control.admit(_request("flood")) for _ in range(14)]
    backlog = [asyncio.ensure_future(control.admit(_request("flood"))) for _ in range(6)]
    light = [asyncio.ensure_future(control.admit(_request("light"))) for _ in range(5)]  # 5 < 16 / 3
    await _settle()
    assert sum(t.done() for t in light) == 2  # the reserve's two slots
    for ticket in flood[:3]:
        ticket.release(100)
        await _settle()
    # The light tenant asked for five at once: the three slots went to it, not the flood.
    assert all(t.done() for t in light) and not any(t.done() for t in backlog)
    assert control.gauges().pools[POOL][3] == 5
    for task in light:
        task.result().release(10)
    await _settle()
    # No light tenant has a request: the reserve is its share again, and the flood fills to 14.
    assert sum(t.done() for t in backlog) == 3 and _state(control)[1] == 14
    assert control.gauges().pools[POOL][3] == 2
    for task in backlog:
        task.cancel()
    await asyncio.gather(*backlog, return_exceptions=True)


async def test_a_higher_band_goes_first_and_a_lower_arrival_waits_behind_it() -> None:
    clock = ManualClock()
    control = _control(Pool(1), clock)
    running = await control.admit(_request("a"))
    low = asyncio.ensure_future(control.admit(_request("b", band=0)))
    high = asyncio.ensure_future(control.admit(_request("c", band=5, work=10_000)))
    await _settle()
    running.release(100)
    await asyncio.wait_for(high, 1)
    assert not low.done()
    high.result().release(10)
    await asyncio.wait_for(low, 1)


async def test_a_request_past_its_ttl_gets_503_with_retry_after_and_leaves_the_queue() -> None:
    clock = ManualClock()
    control = _control(Pool(1), clock)
    await control.admit(_request("a"))
    waiter = asyncio.ensure_future(control.admit(_request("b", ttl_s=5)))
    await clock.settled()
    await clock.advance_async(5)
    with pytest.raises(QueueTimeout) as caught:
        await asyncio.wait_for(waiter, 1)
    assert caught.value.status == 503 and caught.value.headers["retry-after"] == "1"
    assert control.gauges().waiting == {}


async def test_a_cancelled_waiter_leaves_the_queue_and_is_never_let_go() -> None:
    clock = ManualClock()
    control = _control(Pool(1), clock)
    running = await control.admit(_request("a"))
    gone = asyncio.ensure_future(control.admit(_request("b")))
    after = asyncio.ensure_future(control.admit(_request("c")))
    await _settle()
    gone.cancel()
    await _settle()
    assert control.gauges().waiting == {("eu", "tiny", 0, "c"): 1}
    running.release(100)
    await asyncio.wait_for(after, 1)
    assert _state(control) == ({}, 1)


async def test_a_full_queue_sheds_the_sheddable_band_for_a_normal_arrival_and_refuses_when_it_cannot() -> None:
    clock = ManualClock()
    control = _control(Pool(1), clock, flow_queue_max_entries=1)
    await control.admit(_request("a"))
    batch = asyncio.ensure_future(control.admit(_request("batch", band=-1)))
    await _settle()
    normal = asyncio.ensure_future(control.admit(_request("b")))
    await _settle()
    with pytest.raises(QueueFull) as shed:
        await asyncio.wait_for(batch, 1)
    assert "gave its place" in shed.value.message and shed.value.headers["retry-after"] == "1"
    assert not normal.done()
    with pytest.raises(QueueFull):
        await control.admit(_request("c"))  # nothing less urgent left to shed


async def test_a_pool_without_slots_is_not_held() -> None:
    control = _control(Pool(0), ManualClock())
    ticket = await asyncio.wait_for(control.admit(_request("a")), 1)
    assert ticket.control is None
    assert _state(control) == ({}, 0)


async def test_flow_control_off_holds_nothing() -> None:
    control = _control(Pool(1), ManualClock(), flow_control=False)
    for _ in range(3):
        await asyncio.wait_for(control.admit(_request("a")), 1)


async def test_a_ticket_releases_once() -> None:
    clock = ManualClock()
    control = _control(Pool(2), clock)
    ticket = await control.admit(_request("a"))
    await control.admit(_request("b"))
    ticket.release(10)
    ticket.release(10)
    assert _state(control) == ({}, 1)


async def test_closed_loop_tenants_get_their_weighted_shares_the_reserve_bypasses_no_one() -> None:
    """Each tenant sends its next request as soon as one of its own ends (closed loop), the
    way the reserve could be abused: a tenant that just finished one is below its fair
    share, but it still waits its turn, so work served follows the weights 2:1:1."""
    clock = ManualClock()
    control = _control(Pool(8), clock, flow_reserve_share=0.25)
    weights = {"first": 2.0, "second": 1.0, "third": 1.0}
    work = {"first": 100.0, "second": 400.0, "third": 800.0}
    served: dict[str, float] = dict.fromkeys(weights, 0.0)
    running: list[tuple[str, Ticket]] = []

    async def send(tenant: str) -> None:
        ticket = await control.admit(_request(tenant, work=work[tenant], weight=weights[tenant]))
        running.append((tenant, ticket))

    pending = {asyncio.ensure_future(send(t)) for t in weights for _ in range(24)}  # all backlogged
    await _settle()
    for _ in range(600):
        tenant, ticket = running.pop(0)  # the oldest ends; its tenant sends the next at once
        served[tenant] += work[tenant]
        ticket.release(work[tenant])
        pending.add(asyncio.ensure_future(send(tenant)))
        await _settle()
    total, wsum = sum(served.values()), sum(weights.values())
    for tenant, w in weights.items():
        assert served[tenant] / total == pytest.approx(w / wsum, rel=0.1), served
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def test_calibration_moves_a_fifth_of_the_way_and_stays_bounded() -> None:
    assert calibrated(1.0, 100, 300) == pytest.approx(1.4)
    assert calibrated(1.0, 100, 100) == 1.0
    assert calibrated(8.0, 100, 10_000) == 8.0 and calibrated(0.125, 100, 1) == 0.125


async def test_a_tenants_estimates_learn_what_its_answers_turned_out_to_be() -> None:
    """Its prompts are three times the tokens the estimate says: after some answers, its
    waiting requests are charged what they will cost, not a third of it."""
    clock = ManualClock()
    control = _control(Pool(1), clock)
    for _ in range(30):
        ticket = await control.admit(_request("dense", work=100))
        ticket.release(300)
    await control.admit(_request("other"))
    waiter = asyncio.ensure_future(control.admit(_request("dense", work=100)))
    await _settle()
    queued = control.pools()[POOL].queue.peek()
    assert queued is not None and queued.work == pytest.approx(300, rel=0.05)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


async def test_answers_of_requests_in_flight_together_do_not_overshoot_the_correction() -> None:
    """Sixteen requests go at once, before any answer, and each answer is three times its
    estimate: the correction comes near 3 and not past it (scaling it by each answer's error
    against the corrected estimate compounded to 8, then swung back)."""
    clock = ManualClock()
    control = _control(Pool(16), clock)
    tickets = [await control.admit(_request("dense", work=100)) for _ in range(16)]
    for ticket in tickets:
        ticket.release(300)
    held = [await control.admit(_request("other")) for _ in range(16)]
    waiter = asyncio.ensure_future(control.admit(_request("dense", work=100)))
    await _settle()
    queued = control.pools()[POOL].queue.peek()
    assert queued is not None and 250 <= queued.work <= 300
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    for ticket in held:
        ticket.release(100)


def test_a_routers_quota_is_its_max_min_fair_part_of_the_demand() -> None:
    assert Peers(others=15, others_demand=(80,), own_demand=70).quota(30) == 15  # both backlogged
    assert Peers(others=4, others_demand=(5,), own_demand=70).quota(30) == 25  # the other asks less
    assert Peers(others=4, others_demand=(80,), own_demand=3).quota(30) == 3  # this one asks less
    assert Peers(others=9, others_demand=(2, 40, 40), own_demand=40).quota(30) == 9  # 28 left by 3, down
    assert Peers(others=0, others_demand=(), own_demand=40).quota(30) == 30


def test_with_peers_a_router_fills_its_quota_while_others_wait_and_free_room_otherwise() -> None:
    # Two routers, both backlogged: each has half of the 30 slots below a reserve of 2.
    both = Capacity(slots=32, others=15, peers=Peers(others=15, others_demand=(80,), own_demand=80))
    assert Room.of(both, running=14, reserve=2).admits(False)
    assert not Room.of(both, running=15, reserve=2).admits(False)
    # A hole the other router has not refilled yet is not room while it has requests waiting.
    hole = Capacity(slots=32, others=12, peers=Peers(others=12, others_demand=(80,), own_demand=80))
    assert not Room.of(hole, running=15, reserve=2).admits(False)
    # Room nobody else waits for is anyone's: a burst need not wait for the next sync.
    idle = Capacity(slots=32, others=12, peers=Peers(others=12, others_demand=(12,), own_demand=2))
    assert Room.of(idle, running=15, reserve=2).admits(False)
    # The reserve goes by what is in use: 15 + 15 leaves it for a light tenant's request.
    assert Room.of(both, running=15, reserve=2).admits(True)
    fuller = Capacity(slots=32, others=17, peers=Peers(others=17, others_demand=(80,), own_demand=80))
    assert not Room.of(fuller, running=15, reserve=2).admits(True)
    # Without peers: whatever is free, the others' requests as counted.
    assert Room.of(Capacity(slots=32, others=12), running=17, reserve=2).admits(False)


class _Router:
    """One router of the simulation below: its flow control and what it last read."""

    def __init__(self, clock: ManualClock) -> None:
        self.capacity = Capacity(30)
        self.control = FlowControl(RouterSettings(cluster_token=SecretStr("t"), flow_reserve_share=0.0),
                                   lambda _key: self.capacity, clock)
        self.running: list[tuple[int, Ticket]] = []  # (the tick it ends at, its ticket)


async def _two_routers_flooded(shared: bool, ticks: int = 6000) -> tuple[int, int, float]:
    """Two routers let a flood into one pool of 32 slots as fast as they see room below its
    reserve of 2 (the flood is never light: 30 slots as it sees them); a request runs 2-6 s. Each reads the others' requests every 10 ticks
    (100 ms), half of them apart: published by the routers, both backlogged (`shared`), or
    as a node report that counts a few requests that just moved (the noise of
    nodes scraped at different moments). Ticks of 10 ms. The most and fewest requests the pool
    ran once warm, and the share of the time all 32 slots were taken (a light tenant's request
    beside the flood found no slot: the reserve was eaten)."""
    rng, clock = random.Random(7), ManualClock()
    fleet = [_Router(clock) for _ in range(2)]
    most, fewest, full = 0, 32, 0
    for tick in range(ticks):
        for i, router in enumerate(fleet):
            for end, ticket in [r for r in router.running if r[0] <= tick]:
                router.running.remove((end, ticket))
                ticket.release(100)
            if tick % 10 == 5 * i:
                theirs = len(fleet[1 - i].running)
                backlogged = Peers(theirs, (theirs + 50,), len(router.running) + 50)
                router.capacity = Capacity(30, theirs, backlogged) if shared else Capacity(30, theirs + rng.randint(-2, 2))
            while (ticket := router.control.admit_now(_request("flood", work=1e6))) is not None:
                router.running.append((tick + rng.randint(200, 600), ticket))
        total = sum(len(r.running) for r in fleet)
        if tick >= 1000:
            most, fewest, full = max(most, total), min(fewest, total), full + (total >= 32)
    return most, fewest, full / (ticks - 1000)


async def test_two_routers_with_quotas_keep_the_pool_at_its_slots_less_the_reserve() -> None:
    most, fewest, full = await _two_routers_flooded(shared=True)
    assert most <= 30 and fewest >= 29 and full == 0, (most, fewest, full)
    # Each filling what it sees free, by a noisy count of the other's: the pool swings over
    # its slots, and the reserve is gone for a good part of the time.
    most, fewest, full = await _two_routers_flooded(shared=False)
    assert most >= 32 and full > 0.05, (most, fewest, full)


async def _light_beside_a_flood(window_s: float, ticks: int = 4000) -> tuple[float, float]:
    """A flood keeps 100 requests at a pool of 32 slots (reserve share 1/16: 2 slots), each
    running 5-15 s; a light tenant's three users each send a request of 1 s, then think
    0.3 s on average (exponential), as bench.flow_control's B does. Ticks of 10 ms. Of the
    light tenant's requests sent once warm, the share that waited; and the pool's mean
    requests running (the flood must still fill what the light tenant leaves)."""
    rng, clock = random.Random(3), ManualClock()
    control = _control(Pool(32), clock, flow_reserve_share=0.0625, flow_reserve_window_s=window_s)
    ends: list[tuple[int, str, Ticket]] = []  # (the tick it ends at, its tenant, its ticket)
    waits: list[asyncio.Task[Ticket]] = []
    light_sends: list[tuple[int, asyncio.Task[Ticket]]] = []
    thinking: list[int] = [0, 0, 0]  # the tick each light user sends at (-1: its request is out)
    waited = sent = running = 0
    for tick in range(ticks):
        for end in [e for e in ends if e[0] <= tick]:
            ends.remove(end)
            end[2].release(100)
            if end[1] == "light":
                thinking[thinking.index(-1)] = tick + round(rng.expovariate(1 / 30))
        while len(waits) + sum(e[1] == "flood" for e in ends) < 100:
            waits.append(asyncio.ensure_future(control.admit(_request("flood", work=1e4, ttl_s=1e6))))
        for user, at in enumerate(thinking):
            if at == tick:
                thinking[user] = -1
                light_sends.append((tick, asyncio.ensure_future(control.admit(_request("light")))))
        await _settle()
        for task in [t for t in waits if t.done()]:
            waits.remove(task)
            ends.append((tick + rng.randint(500, 1500), "flood", task.result()))
        for sent_at, task in [s for s in light_sends if s[1].done()]:
            light_sends.remove((sent_at, task))
            ends.append((tick + 100, "light", task.result()))
            if sent_at >= 1000:
                sent, waited = sent + 1, waited + (tick > sent_at)
        if tick >= 1000:
            running += _state(control)[1]
        await clock.advance_async(0.01)
    for task in waits + [t for _, t in light_sends]:
        task.cancel()
    await asyncio.gather(*waits, *[t for _, t in light_sends], return_exceptions=True)
    await control.aclose()
    return waited / sent, running / (ticks - 1000)


async def test_the_reserve_grows_to_the_light_tenants_demand_so_their_requests_never_wait() -> None:
    """Three light requests at once against a reserve of two: with the reserve sized by the
    light tenants' recent peak, none of its requests waits for a flood's to end, and the
    flood still fills the slots the light tenant is not using (31.3 of 32 running)."""
    waited, running = await _light_beside_a_flood(window_s=10.0)
    assert waited == 0.0 and running >= 30.5, (waited, running)
    # A window too short to remember the light tenant's last burst: the flood refills the
    # reserve while the light tenant thinks, and its next burst waits (half its requests;
    # 3% with a fixed reserve of two that the light tenant's requests counted against).
    waited, _ = await _light_beside_a_flood(window_s=0.01)
    assert waited > 0.2, waited
