"""Flow control's queue on its own: bands first, then the tenant with the least weighted work,
FCFS within a tenant; an idle tenant banks no credit; deadlines; shedding only what is less
urgent and sheddable, never a partial shed."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter

import pytest

from geo_router.admission.flow_queue import Entry, FlowCaps, FlowQueue, LocalCounters, Refusal

ROOMY = FlowCaps(max_entries=10_000, max_bytes=1 << 30)
_ids = itertools.count()


def _entry(tenant: str, *, band: int = 0, work: float = 100, size: int = 1, expires_at: float = 1e9,
           weight: float = 1.0, sheddable: bool = False) -> Entry[int]:
    return Entry(next(_ids), tenant, band, work, size, expires_at, weight, sheddable)


def _drain(q: FlowQueue[int]) -> list[Entry[int]]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e)
    return out


def _queued(q: FlowQueue[int], entry: Entry[int]) -> Entry[int]:
    refusal, shed = q.push(entry)
    assert (refusal, shed) == (None, [])
    return entry


def test_a_higher_band_goes_first_and_fcfs_holds_within_a_tenant() -> None:
    q: FlowQueue[int] = FlowQueue(ROOMY)
    low = [_queued(q, _entry("a", band=0)) for _ in range(3)]
    high = [_queued(q, _entry("b", band=5)) for _ in range(2)]
    assert [e.item for e in _drain(q)] == [e.item for e in high + low]
    assert len(q) == 0 and q.bytes == 0


def test_backlogged_tenants_get_equal_tokens_not_equal_requests() -> None:
    q: FlowQueue[int] = FlowQueue(ROOMY)
    for _ in range(200):
        _queued(q, _entry("long", work=1000))
        _queued(q, _entry("short", work=100))
    served: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    for _ in range(110):  # both stay backlogged throughout
        e = q.pop()
        assert e is not None
        served[e.tenant] += int(e.work)
        requests[e.tenant] += 1
    # Within one long request of each other, however many requests that takes.
    assert abs(served["long"] - served["short"]) <= 1000
    assert requests["short"] >= 9 * requests["long"]


@pytest.mark.parametrize("weights", [(2.0, 1.0, 1.0), (1.0, 1.0, 1.0)])
def test_weights_divide_the_work(weights: tuple[float, float, float]) -> None:
    q: FlowQueue[int] = FlowQueue(ROOMY)
    tenants = ["a", "b", "c"]
    works = {"a": 300, "b": 120, "c": 700}  # different prompt lengths
    for _ in range(400):
        for t, w in zip(tenants, weights, strict=True):
            _queued(q, _entry(t, work=works[t], weight=w))
    served: Counter[str] = Counter()
    for _ in range(300):
        e = q.pop()
        assert e is not None
        served[e.tenant] += int(e.work)
    total = sum(served.values())
    for t, w in zip(tenants, weights, strict=True):
        share = w / sum(weights)
        assert served[t] / total == pytest.approx(share, rel=0.1)


def test_an_idle_tenant_banks_no_credit() -> None:
    counters = LocalCounters()
    q: FlowQueue[int] = FlowQueue(ROOMY, counters)
    for _ in range(50):  # "busy" alone for a while: its counter climbs
        _queued(q, _entry("busy"))
        q.pop()
    for _ in range(20):
        _queued(q, _entry("busy"))
    _queued(q, _entry("late"))
    for _ in range(20):
        _queued(q, _entry("late"))
    # The late tenant starts level with the busy one, so they alternate rather than the late
    # one taking the next twenty turns.
    order = [e.tenant for e in _drain(q)][:10]
    assert Counter(order) == Counter({"busy": 5, "late": 5})


def test_a_tenant_that_starts_to_wait_level_with_another_goes_first() -> None:
    q: FlowQueue[int] = FlowQueue(ROOMY)
    for _ in range(3):
        _queued(q, _entry("flood", work=750))
    q.pop()
    short = _queued(q, _entry("light", work=750))  # lifted level with the flood's counter
    assert q.pop() is short
    assert [e.tenant for e in _drain(q)] == ["flood", "flood"]


def test_an_idle_tenant_arriving_at_an_empty_queue_starts_from_the_last_served() -> None:
    counters = LocalCounters()
    q: FlowQueue[int] = FlowQueue(ROOMY, counters)
    for _ in range(30):
        _queued(q, _entry("busy"))
        q.pop()
    _queued(q, _entry("late"))
    assert counters.level("late") == counters.level("busy") == 3000


def test_settle_corrects_the_estimate() -> None:
    counters = LocalCounters()
    q: FlowQueue[int] = FlowQueue(ROOMY, counters)
    e = _queued(q, _entry("a", work=500, weight=2.0))
    assert q.pop() is e and counters.level("a") == 250
    q.settle(e, actual_work=100)
    assert counters.level("a") == 50


def test_expired_entries_come_out_oldest_first_and_the_rest_stay_in_order() -> None:
    q: FlowQueue[int] = FlowQueue(ROOMY)
    a1 = _queued(q, _entry("a", expires_at=10))
    b1 = _queued(q, _entry("b", expires_at=30))
    a2 = _queued(q, _entry("a", expires_at=5))
    assert q.next_deadline() == 5
    assert q.expired(4) == []
    assert q.expired(10) == [a1, a2]
    assert q.next_deadline() == 30 and [e.item for e in _drain(q)] == [b1.item]


def test_a_full_queue_sheds_the_newest_of_the_lowest_sheddable_band() -> None:
    q: FlowQueue[int] = FlowQueue(FlowCaps(max_entries=4, max_bytes=1 << 20))
    keep = _queued(q, _entry("a", band=1))
    old = _queued(q, _entry("b", band=0, sheddable=True))
    mid = _queued(q, _entry("c", band=2, sheddable=True))
    new = _queued(q, _entry("b", band=0, sheddable=True))
    arrival = _entry("d", band=1)
    assert q.push(arrival) == (None, [new])  # band 0 before band 2, its newest first
    assert q.push(_entry("e", band=3)) == (None, [old])
    assert q.push(_entry("f", band=3)) == (None, [mid])
    # Nothing sheddable below: the arrival is refused and nothing is shed.
    assert q.push(_entry("g", band=3)) == (Refusal.FULL, [])
    assert q.push(_entry("h", band=9, sheddable=True)) == (Refusal.FULL, [])
    assert keep in _drain(q)


def test_the_byte_cap_sheds_enough_or_nothing() -> None:
    q: FlowQueue[int] = FlowQueue(FlowCaps(max_entries=100, max_bytes=1000))
    small = [_queued(q, _entry("s", band=0, size=200, sheddable=True)) for _ in range(2)]
    firm = _queued(q, _entry("f", band=0, size=500))
    # 900 held: a 500-byte arrival needs both small ones gone, and gets that.
    assert q.push(_entry("x", band=1, size=500)) == (None, small[::-1])
    # 1000 held: a 100-byte arrival could only displace firm, which is not sheddable: refused.
    assert q.push(_entry("y", band=1, size=100)) == (Refusal.FULL, [])
    assert q.bytes == 1000 and firm in _drain(q)
    assert q.push(_entry("z", size=1001)) == (Refusal.FULL, [])  # larger than the queue


def test_an_arrival_never_displaces_its_own_band_or_a_more_urgent_one() -> None:
    q: FlowQueue[int] = FlowQueue(FlowCaps(max_entries=2, max_bytes=1 << 20))
    held = [_queued(q, _entry("a", band=2, sheddable=True)), _queued(q, _entry("b", band=1, sheddable=True))]
    assert q.push(_entry("c", band=1, sheddable=True)) == (Refusal.FULL, [])  # its own band: it is the newest
    assert q.push(_entry("d", band=0)) == (Refusal.FULL, [])  # less urgent than both
    assert [e.item for e in _drain(q)] == [e.item for e in held]



def _closed_loop_shares(clients: dict[str, int], weights: dict[str, float], works: dict[str, float],
                        slots: int, completions: int = 3000) -> dict[str, float]:
    """Each tenant's share of the work served through `slots` slots when each of its `clients`
    sends its next request a moment (0 to 20 ticks) after its last one ended, every request
    taking 80 to 120 ticks (seeded: the same run every time)."""
    rng = random.Random(7)
    q: FlowQueue[int] = FlowQueue(ROOMY)
    order = itertools.count()
    events: list[tuple[float, int, str | Entry[int]]] = []  # (when, order, arriving tenant or ending entry)
    for tenant, n in clients.items():
        for _ in range(n):
            heapq.heappush(events, (rng.uniform(0, 20), next(order), tenant))
    served: Counter[str] = Counter()
    running = ended = 0
    while ended < completions:
        now, _, event = heapq.heappop(events)
        if isinstance(event, str):
            _queued(q, _entry(event, work=works[event], weight=weights[event]))
        else:
            q.settle(event, actual_work=event.work)
            served[event.tenant] += int(event.work)
            running, ended = running - 1, ended + 1
            heapq.heappush(events, (now + rng.uniform(0, 20), next(order), event.tenant))
        while running < slots and (e := q.pop()) is not None:
            running += 1
            heapq.heappush(events, (now + rng.uniform(80, 120), next(order), e))
    total = sum(served.values())
    return {t: served[t] / total for t in clients}


def test_a_weighted_tenant_whose_flow_empties_between_requests_keeps_its_share() -> None:
    # Its clients send their next request a moment after the last ends, so the weight-2
    # tenant's flow empties now and then while its requests run; the lift must not make it
    # pay for those again (they were charged in full when they went): it keeps half the work.
    weights = {"heavy": 2.0, "b": 1.0, "c": 1.0}
    works = {"heavy": 130.0, "b": 330.0, "c": 600.0}  # short, middling and long prompts
    shares = _closed_loop_shares({"heavy": 16, "b": 16, "c": 16}, weights, works, slots=16)
    assert shares["heavy"] == pytest.approx(0.5, abs=0.015)


def test_the_lift_allowance_is_the_work_running_and_ends_with_it() -> None:
    counters = LocalCounters()
    q: FlowQueue[int] = FlowQueue(ROOMY, counters)
    went = _queued(q, _entry("a", work=300))
    assert q.pop() is went  # a's 300 runs, charged up front
    b_went = []
    for _ in range(10):
        _queued(q, _entry("b", work=100))
        b_went.append(q.pop())  # b alone (lifted to a's 300): its counter climbs by 1000
    _queued(q, _entry("b", work=100))
    assert q.running_work("a") == 300 and counters.level("b") == 1300
    _queued(q, _entry("a"))  # a starts to wait again with 300 still running
    assert counters.level("a") == 1300 - 300
    q.settle(went, actual_work=300)
    assert q.running_work("a") == 0
    for e in _drain(q):
        q.settle(e, actual_work=e.work)
    assert q.running_work("a") == 0
    for _ in range(10):
        _queued(q, _entry("b", work=100))
        q.pop()
    _queued(q, _entry("b", work=100))
    _queued(q, _entry("a"))  # nothing of a's runs now: level with b, no credit kept
    assert counters.level("a") == counters.level("b")
