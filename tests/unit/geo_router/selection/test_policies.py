"""Routing policies: affinity scoring, the imbalance gate, LoRA preference, region spill, baselines."""

from __future__ import annotations

from collections import Counter

from candidate_kit import CTX, cand

from geo_router.selection.candidates import Candidate, LoraState
from geo_router.selection.policies import (
    AffinityPolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
    create_policy,
    policy_names,
)
from meridian.settings.router import RouterSettings


def ids(cands: list[Candidate]) -> list[str]:
    return [c.node.node_id for c in cands]


def test_affinity_prefers_the_replica_holding_the_prompt_prefix():
    policy = AffinityPolicy()
    cands = [cand("a", prefix_hit=0.0), cand("b", prefix_hit=0.8), cand("c", prefix_hit=0.1)]
    assert ids(policy.order(cands, CTX))[0] == "b"


def test_affinity_accepts_a_little_more_load_for_a_long_prefix_but_not_a_hot_spot():
    policy = AffinityPolicy(imbalance_abs=4, imbalance_ratio=1.5)
    busy_holder = [cand("a", in_flight=3, prefix_hit=0.9), cand("b", in_flight=1), cand("c", in_flight=1)]
    assert ids(policy.order(busy_holder, CTX))[0] == "a"
    # Six more pending than the idle replica: the gate sends it to the least loaded one.
    hot_holder = [cand("a", in_flight=7, prefix_hit=0.95), cand("b", in_flight=1), cand("c", in_flight=2)]
    assert ids(policy.order(hot_holder, CTX))[0] == "b"
    assert policy.imbalance_fallbacks == 1


def test_with_nothing_cached_anywhere_affinity_is_least_load_then_fewest_recent():
    # A prompt no replica holds (or whose shared system prompt all hold): the recent-share
    # balance only breaks ties in load; it never sends a request to a longer queue.
    policy = AffinityPolicy()
    cands = [cand("busy-but-rarely-used", in_flight=3, recent=0.0, prefix_hit=0.2),
             cand("idle-but-often-used", in_flight=1, recent=9.0, prefix_hit=0.2),
             cand("idle-rarely-used", in_flight=1, recent=2.0, prefix_hit=0.2)]
    assert ids(policy.order(cands, CTX)) == ["idle-rarely-used", "idle-but-often-used", "busy-but-rarely-used"]
    assert policy.imbalance_fallbacks == 0


def test_reported_load_counts_even_when_this_router_sent_nothing():
    # Another router's requests show in the node's running/waiting, not in our in-flight.
    policy = AffinityPolicy()
    cands = [cand("a", running=8, waiting=4), cand("b", running=1)]
    assert ids(policy.order(cands, CTX))[0] == "b"


def test_lora_loaded_beats_free_slot_beats_neither():
    policy = AffinityPolicy()
    cands = [cand("none", lora=LoraState.NONE), cand("slot", lora=LoraState.FREE_SLOT),
             cand("loaded", lora=LoraState.LOADED)]
    assert ids(policy.order(cands, CTX)) == ["loaded", "slot", "none"]


def test_nearest_region_first_and_failover_order_covers_every_region():
    policy = AffinityPolicy(latency_objective_ms=500)
    cands = [cand("eu-a", "eu", rtt_ms=90), cand("us-a", "us", rtt_ms=5, prefix_hit=0.0),
             cand("eu-b", "eu", rtt_ms=90, prefix_hit=1.0), cand("apac-a", "apac", rtt_ms=160)]
    assert ids(policy.order(cands, CTX)) == ["us-a", "eu-b", "eu-a", "apac-a"]


def test_a_region_whose_queueing_breaks_the_objective_spills_to_the_next_one():
    policy = AffinityPolicy(latency_objective_ms=500)
    queued = [cand("us-a", "us", rtt_ms=5, waiting=9, queue_ms=900),
              cand("us-b", "us", rtt_ms=5, waiting=7, queue_ms=700),
              cand("eu-a", "eu", rtt_ms=90, queue_ms=0)]
    assert ids(policy.order(queued, CTX)) == ["eu-a", "us-b", "us-a"]
    # Only queueing spills: when no region meets the objective, the cheapest goes first.
    everywhere = [cand("us-a", "us", rtt_ms=5, queue_ms=900), cand("eu-a", "eu", rtt_ms=90, queue_ms=2000)]
    assert ids(policy.order(everywhere, CTX)) == ["us-a", "eu-a"]


def test_idle_equal_replicas_take_turns():
    for policy in (AffinityPolicy(), LeastLoadPolicy(), RoundRobinPolicy()):
        cands = [cand("a"), cand("b"), cand("c"), cand("d")]
        firsts = Counter(ids(policy.order(cands, CTX))[0] for _ in range(400))
        assert set(firsts) == {"a", "b", "c", "d"}, policy.name
        assert max(firsts.values()) == min(firsts.values()) == 100, policy.name


def test_round_robin_ignores_load_and_prefix_but_not_distance():
    policy = RoundRobinPolicy()
    cands = [cand("a", in_flight=50, prefix_hit=0.0), cand("b", prefix_hit=1.0), cand("x", "eu", rtt_ms=90)]
    firsts = Counter(ids(policy.order(cands, CTX))[0] for _ in range(10))
    assert firsts == {"a": 5, "b": 5}
    assert ids(policy.order(cands, CTX))[-1] == "x"


def test_least_load_picks_the_fewest_pending():
    cands = [cand("a", in_flight=3), cand("b", running=2, waiting=2), cand("c", in_flight=1)]
    assert ids(LeastLoadPolicy().order(cands, CTX)) == ["c", "a", "b"]


def test_every_registered_policy_builds_from_settings_and_keeps_the_candidates():
    settings = RouterSettings(cluster_token="t")
    cands = [cand("a"), cand("b", "eu", rtt_ms=90), cand("c", prefix_hit=0.5)]
    assert {"affinity", "nearest", "least-load", "round-robin"} <= set(policy_names())
    for name in policy_names():
        if name.endswith("-test"):
            continue
        ordered = create_policy(name, settings).order(cands, CTX)
        assert sorted(ids(ordered)) == ["a", "b", "c"], name
    assert create_policy(settings.routing_policy, settings).name == "affinity"
