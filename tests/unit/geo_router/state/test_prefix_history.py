"""The approximate prefix index of one router: prefix walk, TTL, bounded LRU, forgetting."""

from __future__ import annotations

from router_harness import router_settings

from geo_router.state.prefix_history import InProcessPrefixHistory
from meridian.clock import ManualClock


def history(ttl_s: float = 10.0, max_keys: int = 1000, **kw: int) -> tuple[InProcessPrefixHistory, ManualClock]:
    clock = ManualClock()
    return InProcessPrefixHistory(ttl_s, max_keys, clock=clock, **kw), clock


def test_match_counts_each_nodes_leading_keys_and_stops_at_its_first_miss() -> None:
    h, _ = history()
    h.record("a", [1, 2, 3])
    h.record("b", [1, 2])
    h.record("c", [9])
    h.record("d", [1, 3])  # holds key 3 but not 2: only the first key counts
    assert h.match([1, 2, 3, 4], ["a", "b", "c", "d", "e"]) == {"a": 3, "b": 2, "c": 0, "d": 1, "e": 0}
    assert h.match([7, 1, 2], ["a", "b"]) == {"a": 0, "b": 0}
    assert h.match([], ["a"]) == {"a": 0}


def test_a_record_is_believed_for_the_ttl_and_a_new_one_extends_it() -> None:
    h, clock = history(ttl_s=10.0)
    h.record("a", [1, 2])
    clock.advance(6)
    h.record("a", [1])  # a later request with the same start
    clock.advance(4.5)
    assert h.match([1, 2], ["a"]) == {"a": 1}  # key 2 expired, key 1 was refreshed
    clock.advance(6)
    assert h.match([1, 2], ["a"]) == {"a": 0}
    assert len(h) == 2  # expired keys stay until the next record...
    h.record("b", [5])
    assert len(h) == 1  # ...which drops them


def test_the_least_recently_routed_keys_go_first_when_full() -> None:
    h, _ = history(max_keys=4)
    h.record("a", [1, 2])
    h.record("a", [3, 4])
    h.record("b", [1])  # key 1 routed again: now the most recent
    h.record("a", [5])
    assert len(h) == 4
    assert h.match([1], ["a", "b"]) == {"a": 1, "b": 1}
    assert h.match([2], ["a"]) == {"a": 0}
    assert h.match([3, 4], ["a"]) == {"a": 2}
    assert h.match([5], ["a"]) == {"a": 1}


def test_a_forgotten_node_holds_nothing_until_it_is_sent_prompts_again() -> None:
    h, _ = history()
    h.record("a", [1, 2, 3])
    h.record("b", [1, 2])
    h.forget_node("a")
    assert h.match([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 2}
    h.record("a", [1])
    assert h.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}


def test_a_key_remembers_a_bounded_number_of_nodes_the_latest_first() -> None:
    h, clock = history(max_nodes_per_key=3)
    for i in range(5):
        clock.advance(1)
        h.record(f"n{i}", [42])
    assert h.match([42], [f"n{i}" for i in range(5)]) == {"n0": 0, "n1": 0, "n2": 1, "n3": 1, "n4": 1}


def test_fresh_keys_are_the_new_ones_and_those_last_recorded_half_a_ttl_ago() -> None:
    h, clock = history(ttl_s=10.0)
    assert h.record_fresh("a", [1, 2]) == [1, 2]
    assert h.record_fresh("a", [1, 2, 3]) == [3]
    assert h.record_fresh("b", [1]) == [1]  # new for that node
    clock.advance(5.5)
    assert h.record_fresh("a", [1, 2, 3]) == [1, 2, 3]
    h.forget_node("a")
    assert h.record_fresh("a", [1]) == [1]


def test_merged_records_never_shorten_what_is_known() -> None:
    h, clock = history(ttl_s=10.0)
    h.record("a", [1])
    h.merge("a", [1, 2], until=clock.monotonic() + 2)
    h.merge("a", [3], until=clock.monotonic() - 1)  # already expired when it arrived
    clock.advance(3)
    assert h.match([1, 2], ["a"]) == {"a": 1}
    assert h.match([3], ["a"]) == {"a": 0}
    # Merged keys are not this router's news: recording them is.
    h.merge("b", [7], until=clock.monotonic() + 9)
    assert h.record_fresh("b", [7]) == []


def test_settings_size_the_history() -> None:
    h = InProcessPrefixHistory.from_settings(router_settings(prefix_history_ttl_s=7.0, prefix_history_max_keys=2))
    h.record("a", [1, 2, 3])
    assert h.ttl_s == 7.0 and len(h) == 2


def test_holders_name_the_nodes_with_the_longest_run_most_recent_first_whatever_the_candidates() -> None:
    h, clock = history(ttl_s=10.0)
    h.record("a", [1, 2])
    clock.advance(1)
    h.record("b", [1, 2, 3])
    clock.advance(1)
    h.record("c", [1, 2, 3])
    h.record("d", [9])
    assert h.holders([1, 2, 3, 4], limit=4) == ["c", "b"]
    assert h.holders([1, 2, 3, 4], limit=1) == ["c"]
    assert h.holders([1, 2], limit=4) == ["c", "b", "a"]
    assert h.holders([7, 8], limit=4) == [] and h.holders([], limit=4) == []
    h.forget_node("c")  # its cache is gone
    assert h.holders([1, 2, 3], limit=4) == ["b"]
    clock.advance(9.5)  # b's record expired, c's epoch is stale: nobody holds key 3
    assert h.holders([1, 2, 3], limit=4) == []
