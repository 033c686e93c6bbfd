"""The reaper's decision on what a pass observed (control_plane.reaper.decide): the
thresholds at their edges, without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cp_harness import CLUSTER_TOKEN
from pydantic import SecretStr

from control_plane.reaper import FleetObservation, Hold, ReapPolicy, SilentNode, decide
from meridian.settings.control_plane import ControlPlaneSettings

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = ReapPolicy.from_settings(
    ControlPlaneSettings(cluster_token=SecretStr(CLUSTER_TOKEN), node_ttl_s=10, heartbeat_interval_s=2))


def _observed(live: dict[str, int], silent: list[tuple[str, str]], newest_age_s: float = 0.5,
              size: dict[str, int] | None = None) -> FleetObservation:
    """`silent` as (node, region), longest silent first."""
    return FleetObservation(
        now=NOW, live=live, size=size or live, newest_heartbeat=NOW - timedelta(seconds=newest_age_s),
        silent=tuple(SilentNode(n, r, NOW - timedelta(seconds=20 - i)) for i, (n, r) in enumerate(silent)),
    )


def test_the_defaults_follow_the_heartbeat_interval() -> None:
    assert POLICY.stall_s == 2 and POLICY.behind_after == timedelta(seconds=4)
    assert POLICY.grace_s == 10 + 10  # the TTL plus the nodes' longest retry backoff
    assert not POLICY.late(1.0 + 2.0) and POLICY.late(1.0 + 2.01)


def test_half_the_fleet_silent_is_expired_more_than_half_holds() -> None:
    half = _observed({"a": 2, "b": 2}, [("a1", "a"), ("b1", "b")])
    assert decide(half, POLICY).expire == ("a1", "b1")
    most = _observed({"a": 2, "b": 2}, [("a1", "a"), ("b1", "b"), ("b2", "b")])
    assert decide(most, POLICY).hold is Hold.FLEET_SILENT
    assert decide(most, POLICY).deferred == ("a1", "b1", "b2") and decide(most, POLICY).expire == ()


def test_no_heartbeat_recorded_for_two_intervals_holds_whatever_the_share() -> None:
    one = [("a1", "a")]
    assert decide(_observed({"a": 10}, one, newest_age_s=4.0), POLICY).expire == ("a1",)
    assert decide(_observed({"a": 10}, one, newest_age_s=4.01), POLICY).hold is Hold.HEARTBEATS_BEHIND


def test_a_lone_node_is_expired_a_fleet_of_two_holds() -> None:
    assert decide(_observed({"a": 1}, [("a1", "a")], newest_age_s=30), POLICY).expire == ("a1",)
    both = _observed({"a": 2}, [("a1", "a"), ("a2", "a")], newest_age_s=30)
    assert decide(both, POLICY).hold is Hold.HEARTBEATS_BEHIND


def test_a_region_loses_at_most_a_fifth_of_its_nodes_per_pass_at_least_one() -> None:
    region = [(f"a{i}", "a") for i in range(10)]
    observed = _observed({"a": 10, "b": 30}, region)
    decision = decide(observed, POLICY)
    assert decision.expire == ("a0", "a1") and decision.deferred == tuple(f"a{i}" for i in range(2, 10))
    # Later passes: the region's size counts its lost nodes too, so the pace stays two a pass.
    later = _observed({"a": 4, "b": 30}, region[6:], size={"a": 10, "b": 30})
    assert decide(later, POLICY).expire == ("a6", "a7")
    small = _observed({"c": 3, "b": 30}, [("c1", "c"), ("c2", "c")])
    assert decide(small, POLICY).expire == ("c1",)


def test_nothing_silent_is_no_hold() -> None:
    assert decide(_observed({"a": 3}, [], newest_age_s=60), POLICY).hold is None
