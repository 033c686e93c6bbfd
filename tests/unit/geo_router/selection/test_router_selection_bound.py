"""A model with more replicas than max_candidates: the bounded candidate set (geo_router.selection.candidates).

The set is at most the bound, holds the nearest regions' replicas, never crosses residency,
spreads the load over every replica request after request, and still reaches the replica a
conversation's prompt went to (through the routing history) and a stored response's node.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from router_harness import EU_KEY, GLOBAL_KEY, REGIONS, router_settings, tenants

from geo_router.errors import NoReplicaInZone
from geo_router.ingress.auth import authenticate
from geo_router.selection.affinity import Affinity
from geo_router.selection.candidates import (
    Candidate,
    FleetView,
    RoutingContext,
    named_candidates,
    select_candidates,
)
from geo_router.selection.policies import AffinityPolicy
from geo_router.selection.prefix import PrefixKeyBuilder
from geo_router.state.health import InProcessFleetState
from geo_router.state.kv_index import KVIndex
from geo_router.state.node_load import NodeLoad
from geo_router.state.prefix_history import InProcessPrefixHistory
from geo_router.state.table import LoadedTable
from meridian.clock import ManualClock
from meridian.contracts import NodeStatus, RoutingNode, RoutingTable, TenantEntry
from meridian.geo import Point

MODEL = "big"
LIMIT = 64  # the tests pass it explicitly; the default is RouterSettings.max_candidates
WASHINGTON = Point(38.9, -77.0)


def fleet_table(per_region: dict[str, int]) -> LoadedTable:
    """`per_region[r]` READY replicas of MODEL in REGIONS[r], ids `<r>-<i>`."""
    nodes = [RoutingNode(node_id=f"{r}-{i:04d}", region=REGIONS[r].name, url=f"http://{r}{i}:1", models=[MODEL],
                         status=NodeStatus.READY)
             for r, count in per_region.items() for i in range(count)]
    nodes.sort(key=lambda n: n.node_id)
    return LoadedTable.build(RoutingTable(version=1, generated_at=datetime.now(UTC), regions=list(REGIONS.values()),
                                          nodes=nodes, tenants=tenants()))


def fleet() -> InProcessFleetState:
    return InProcessFleetState(ejection_base_s=5, ejection_max_s=60)


def tenant(key: str, table: LoadedTable) -> TenantEntry:
    return authenticate(table, f"Bearer {key}")


def ids(cands: list[Candidate]) -> list[str]:
    return [c.node.node_id for c in cands]


def select(table: LoadedTable, key: str = GLOBAL_KEY, where: Point | None = WASHINGTON, *,
           seed: int | random.Random = 0, f: InProcessFleetState | None = None,
           allows: Callable[[str], bool] | None = None, **kw: object) -> list[Candidate]:
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    view = FleetView(f or fleet(), allows=allows)
    return select_candidates(table, tenant(key, table), MODEL, view, where, limit=LIMIT, rng=rng, **kw)


@pytest.mark.parametrize("replicas", [LIMIT + 1, 750, 3000])
def test_never_more_candidates_than_the_bound_and_never_the_same_node_twice(replicas: int) -> None:
    table = fleet_table({"us": replicas // 3, "eu": replicas // 3, "apac": replicas - 2 * (replicas // 3)})
    for seed in range(20):
        got = ids(select(table, seed=seed))
        assert len(got) == LIMIT
        assert len(set(got)) == LIMIT


def test_at_or_below_the_bound_every_usable_replica_is_a_candidate() -> None:
    table = fleet_table({"us": 30, "eu": 20, "apac": 14})
    assert len(select(table)) == LIMIT == 64
    f = fleet()
    f.record_failure("us-0003")
    assert "us-0003" not in ids(select(table, f=f))
    assert len(select(table, f=f)) == LIMIT - 1


def test_the_nearest_regions_replicas_are_always_in_the_set() -> None:
    # 40 replicas in the client's region, thousands further away: all 40 every time.
    table = fleet_table({"us": 40, "eu": 1500, "apac": 1500})
    nearest = {f"us-{i:04d}" for i in range(40)}
    for seed in range(50):
        got = select(table, seed=seed)
        assert nearest <= set(ids(got))
        # The rest is a sample of the further regions, for spilling and failing over.
        assert {c.region.name for c in got} == {REGIONS[r].name for r in ("us", "eu", "apac")}


def test_a_nearest_region_larger_than_the_bound_fills_three_quarters_of_the_set() -> None:
    table = fleet_table({"us": 1000, "eu": 1000, "apac": 1000})
    for seed in range(20):
        regions = Counter(c.region.name for c in select(table, seed=seed))
        assert regions[REGIONS["us"].name] >= LIMIT * 3 // 4


def test_residency_holds_in_a_large_fleet_and_the_503_still_says_when_to_retry() -> None:
    table = fleet_table({"us": 1500, "eu": 100, "apac": 1500})
    eu = REGIONS["eu"].name
    for seed in range(20):
        got = select(table, EU_KEY, seed=seed)  # a client in Washington: eu is far, us is near
        assert len(got) == LIMIT and {c.region.name for c in got} == {eu}
    f = fleet()
    for i in range(100):
        f.record_failure(f"eu-{i:04d}")
    with pytest.raises(NoReplicaInZone) as exc:
        select(table, EU_KEY, f=f)
    assert exc.value.headers == {"retry-after": "5"}  # the first ejection ends in ejection_base_s


def test_ejected_and_refused_replicas_are_skipped_and_the_set_still_fills() -> None:
    table = fleet_table({"us": 100, "eu": 100, "apac": 100})
    f = fleet()
    down = {f"us-{i:04d}" for i in range(0, 100, 2)}
    for node_id in down:
        f.record_failure(node_id)
    refused = {f"eu-{i:04d}" for i in range(0, 100, 2)}
    for seed in range(20):
        got = set(ids(select(table, f=f, seed=seed, allows=lambda n: n not in refused)))
        assert len(got) == LIMIT and not got & (down | refused)


def test_candidate_sets_cover_the_whole_fleet_over_many_requests() -> None:
    # An unknown client: every region is as near, so the set is a uniform sample of all.
    table = fleet_table({"us": 1000, "eu": 1000, "apac": 1000})
    rng = random.Random(3)
    seen: Counter[str] = Counter()
    for _ in range(500):  # 32,000 draws over 3,000 replicas: ~10.7 each
        seen.update(ids(select(table, where=None, seed=rng)))
    assert len(seen) == 3000
    assert max(seen.values()) < 30


def test_the_policys_picks_spread_over_every_replica_of_a_large_nearest_region() -> None:
    table = fleet_table({"us": 100, "eu": 100, "apac": 100})
    t = tenant(GLOBAL_KEY, table)
    clock = ManualClock()
    affinity = Affinity(loads=_NoLoads(), kv_index=KVIndex(), history=InProcessPrefixHistory(300, 10_000, clock=clock),
                        prefixes=PrefixKeyBuilder(router_settings()), clock=clock)
    policy = AffinityPolicy()
    rng = random.Random(11)
    firsts: Counter[str] = Counter()
    for i in range(1000):
        cands, prefix = affinity.annotate(select(table, seed=rng), MODEL, _chat(f"new conversation {i}"))
        first = policy.order(cands, RoutingContext(t, MODEL, False, WASHINGTON, f"r{i}"))[0]
        affinity.chosen(first, MODEL, prefix)
        firsts[first.node.node_id] += 1
        clock.advance(0.05)
    # Nearest region first, as without a bound, and within it every replica takes a share.
    assert set(firsts) == {f"us-{i:04d}" for i in range(100)}
    assert max(firsts.values()) <= 4 * 1000 // 100


def test_a_conversations_replica_left_out_of_the_sample_is_reached_through_the_history() -> None:
    table = fleet_table({"us": 1000, "eu": 1000, "apac": 1000})
    t = tenant(GLOBAL_KEY, table)
    f = fleet()
    affinity = Affinity(loads=_NoLoads(), kv_index=KVIndex(), history=InProcessPrefixHistory(300, 10_000),
                        prefixes=PrefixKeyBuilder(router_settings()))
    sample = select(table, seed=5)
    holder = next(f"us-{i:04d}" for i in range(1000) if f"us-{i:04d}" not in ids(sample))
    # Turn 1 went to `holder`; turn 2 re-sends it and adds a question.
    turn1 = _chat("a long question about the quarterly report " * 20)
    _, prefix = affinity.annotate([*named_candidates(table, t, MODEL, f, WASHINGTON, [holder]), sample[0]],
                                  MODEL, turn1)
    affinity.chosen(named_candidates(table, t, MODEL, f, WASHINGTON, [holder])[0], MODEL, prefix)
    turn2 = _chat("a long question about the quarterly report " * 20, "and a follow-up")

    def more(node_ids: object) -> list[Candidate]:
        return named_candidates(table, t, MODEL, f, WASHINGTON, node_ids)  # type: ignore[arg-type]

    cands, _ = affinity.annotate(select(table, seed=5), MODEL, turn2, more)
    ordered = AffinityPolicy().order(cands, RoutingContext(t, MODEL, False, WASHINGTON, "r2"))
    assert ordered[0].node.node_id == holder and ordered[0].prefix_hit > 0.5
    # Without the hook (the old behaviour) the sample alone cannot reach it.
    cands, _ = affinity.annotate(select(table, seed=5), MODEL, turn2)
    assert holder not in ids(cands)
    # A holder that is ejected is not added: the same checks as every candidate.
    f.record_failure(holder)
    cands, _ = affinity.annotate(select(table, seed=5, f=f), MODEL, turn2, more)
    assert holder not in ids(cands)


def test_a_stored_responses_node_joins_the_set_whatever_the_bound_but_not_across_residency() -> None:
    table = fleet_table({"us": 1000, "eu": 1000, "apac": 1000})
    outside = next(f"apac-{i:04d}" for i in range(1000) if f"apac-{i:04d}" not in ids(select(table, seed=1)))
    got = ids(select(table, seed=1, also=[outside]))
    assert outside in got and len(got) == LIMIT + 1
    assert outside not in ids(select(table, EU_KEY, seed=1, also=[outside]))


class _NoLoads:
    def load(self, node_id: str) -> NodeLoad | None:
        return None


def _chat(*user: str) -> dict[str, object]:
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer questions about reports."}]
    for i, text in enumerate(user):
        if i:
            messages.append({"role": "assistant", "content": f"answer {i}"})
        messages.append({"role": "user", "content": text})
    return {"model": MODEL, "messages": messages}
