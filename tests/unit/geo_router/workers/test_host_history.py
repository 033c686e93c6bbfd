"""The workers of one router share where prompts went at once (geo_router.workers.host_history):
what one worker records, another matches on its next request, with no sync interval."""

from __future__ import annotations

from pathlib import Path

from geo_router.workers.host_history import HostPrefixHistory, create_ring
from geo_router.workers.host_ring import HostRing
from meridian.clock import ManualClock

TTL_S = 300.0


def workers(path: Path, clock: ManualClock, n: int = 2, *, slots: int = 64) -> list[HostPrefixHistory]:
    create_ring(path, slots)
    return [HostPrefixHistory(HostRing(path), i, TTL_S, 10_000, clock=clock) for i in range(n)]


def test_a_turn_recorded_at_one_worker_is_matched_at_the_other(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "ring", clock)
    keys = list(range(1, 80))  # more keys than one record holds
    a.record("eu-1", keys)
    assert b.match([*keys, 999], ["eu-1", "eu-2"]) == {"eu-1": len(keys), "eu-2": 0}
    assert b.holders(keys, 4) == ["eu-1"]
    # The shared belief expires with the TTL, as the recording worker's own does.
    clock.advance(TTL_S + 1)
    assert b.match(keys, ["eu-1"]) == {"eu-1": 0}
    assert a.match(keys, ["eu-1"]) == {"eu-1": 0}


def test_a_forgotten_node_is_forgotten_by_every_worker(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b, c = workers(tmp_path / "ring", clock, n=3)
    a.record("eu-1", [1, 2, 3])
    assert c.match([1, 2, 3], ["eu-1"]) == {"eu-1": 3}
    b.forget_node("eu-1")  # b saw the node restart: its cache is gone
    assert a.match([1, 2, 3], ["eu-1"]) == {"eu-1": 0}
    assert c.match([1, 2, 3], ["eu-1"]) == {"eu-1": 0}
    # Sent there again, it holds them again, for everyone.
    c.record("eu-1", [1, 2])
    assert a.match([1, 2, 3], ["eu-1"]) == {"eu-1": 2}


def test_a_worker_a_whole_ring_behind_keeps_what_was_not_overwritten(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "ring", clock, slots=8)
    for n in range(20):  # twenty records into a ring of eight, while b routes nothing
        a.record(f"node-{n}", [1000 + n])
    seen = {n for n in range(20) if b.match([1000 + n], [f"node-{n}"])[f"node-{n}"]}
    assert seen == set(range(12, 20))


def test_a_worker_that_replaces_a_dead_one_starts_from_what_the_ring_holds(tmp_path: Path) -> None:
    clock = ManualClock()
    path = tmp_path / "ring"
    (a,) = workers(path, clock, n=1)
    a.record("eu-1", [1])
    clock.advance(TTL_S - 1)
    a.record("eu-2", [2])
    clock.advance(2)
    replacement = HostPrefixHistory(HostRing(path), 1, TTL_S, 10_000, clock=clock)
    assert replacement.match([1], ["eu-1"]) == {"eu-1": 0}  # expired meanwhile
    assert replacement.match([2], ["eu-2"]) == {"eu-2": 1}
