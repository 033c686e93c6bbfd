"""Which replicas a request may use and in what order: residency, health, distance, load."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from router_harness import EU_KEY, GLOBAL_KEY, LIMITED_KEY, MODEL, REGIONS, make_table, node

from geo_router.errors import InvalidApiKey, ModelNotFound, NoHealthyReplica, NoReplicaInZone
from geo_router.ingress.auth import authenticate
from geo_router.selection.candidates import (
    Candidate,
    RoutingContext,
    models_for,
    select_candidates,
    zone_ready_replicas,
)
from geo_router.selection.locate import locate_client
from geo_router.selection.policies import NearestPolicy, create_policy, register_policy
from geo_router.state.health import InProcessFleetState
from geo_router.state.table import LoadedTable
from meridian.contracts import DeploymentEntry, NodeStatus, TenantEntry
from meridian.geo import Point
from meridian.registry import UnknownName
from meridian.settings.router import RouterSettings

TABLE = LoadedTable.build(make_table([node("us", "http://us:1"), node("eu", "http://eu:1"),
                                      node("apac", "http://apac:1")]))
REGIONS_BY_NAME = TABLE.regions
AMSTERDAM = Point(52.4, 4.9)
WASHINGTON = Point(38.9, -77.0)


def tenant(key: str, table: LoadedTable = TABLE) -> TenantEntry:
    return authenticate(table, f"Bearer {key}")


def fleet() -> InProcessFleetState:
    return InProcessFleetState(ejection_base_s=5, ejection_max_s=60)


def ordered(table: LoadedTable, key: str, where: Point | None, f: InProcessFleetState | None = None,
            model: str = MODEL) -> list[str]:
    t = tenant(key, table)
    cands = select_candidates(table, t, model, f or fleet(), where)
    ctx = RoutingContext(tenant=t, model=model, stream=False, client_location=where, request_id="r")
    return [c.node.node_id for c in NearestPolicy().order(cands, ctx)]


def test_nearest_region_first_for_a_global_tenant():
    assert ordered(TABLE, GLOBAL_KEY, WASHINGTON) == ["us-1", "eu-1", "apac-1"]
    assert ordered(TABLE, GLOBAL_KEY, AMSTERDAM) == ["eu-1", "us-1", "apac-1"]
    assert ordered(TABLE, GLOBAL_KEY, Point(35.6, 139.7))[0] == "apac-1"


def test_same_region_ties_go_to_the_least_busy_node_then_node_id():
    table = LoadedTable.build(make_table([
        node("us", "http://a:1").model_copy(update={"node_id": "us-b"}),
        node("us", "http://b:1").model_copy(update={"node_id": "us-a"}),
        node("eu", "http://eu:1"),
    ]))
    f = fleet()
    assert ordered(table, GLOBAL_KEY, WASHINGTON, f) == ["us-a", "us-b", "eu-1"]
    f.begin("us-a")
    assert ordered(table, GLOBAL_KEY, WASHINGTON, f) == ["us-b", "us-a", "eu-1"]
    f.end("us-a")
    assert ordered(table, GLOBAL_KEY, WASHINGTON, f) == ["us-a", "us-b", "eu-1"]


def test_eu_tenant_only_ever_gets_eu_nodes_wherever_the_client_is():
    for where in (WASHINGTON, Point(35.6, 139.7), None):
        assert ordered(TABLE, EU_KEY, where) == ["eu-1"]


def test_eu_tenant_with_every_eu_node_ejected_gets_503_not_a_us_node():
    f = fleet()
    f.record_failure("eu-1")
    with pytest.raises(NoReplicaInZone) as e:
        ordered(TABLE, EU_KEY, WASHINGTON, f)
    assert e.value.status == 503 and e.value.code == "no_replica_in_zone"
    assert "`eu`" in e.value.message and "never served outside" in e.value.message
    # The same fleet still serves a global tenant, from the US.
    assert ordered(TABLE, GLOBAL_KEY, WASHINGTON, f)[0] == "us-1"


def test_eu_tenant_when_the_model_runs_only_outside_eu_gets_503_in_zone():
    table = LoadedTable.build(make_table([node("us", "http://us:1")]))
    with pytest.raises(NoReplicaInZone):
        ordered(table, EU_KEY, AMSTERDAM)


def test_global_tenant_with_everything_ejected_gets_no_healthy_replica():
    f = fleet()
    for n in ("us-1", "eu-1", "apac-1"):
        f.record_failure(n)
    with pytest.raises(NoHealthyReplica) as e:
        ordered(TABLE, GLOBAL_KEY, WASHINGTON, f)
    assert e.value.code == "no_healthy_replica"
    # Retry-After: when the first of them is tried again.
    assert e.value.headers["retry-after"] == str(math.ceil(min(f.ejected_for_s(n) for n in ("us-1", "eu-1", "apac-1"))))


def test_only_ready_nodes_are_candidates():
    table = LoadedTable.build(make_table([
        node("us", "http://us:1", status=NodeStatus.DRAINING),
        node("eu", "http://eu:1", status=NodeStatus.STARTING),
        node("apac", "http://apac:1"),
    ]))
    assert ordered(table, GLOBAL_KEY, WASHINGTON) == ["apac-1"]


def test_unknown_or_forbidden_model_is_404():
    with pytest.raises(ModelNotFound) as e:
        ordered(TABLE, GLOBAL_KEY, WASHINGTON, model="no-such-model")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    # Served, but not for this key: the same 404, revealing nothing.
    with pytest.raises(ModelNotFound):
        ordered(TABLE, LIMITED_KEY, WASHINGTON)


def test_models_listing_is_what_the_tenant_may_use_in_its_zone():
    table = LoadedTable.build(make_table([
        node("us", "http://us:1", models=[MODEL, "us-only"]),
        node("eu", "http://eu:1"),
        node("apac", "http://apac:1", models=["other-model"]),
    ]))
    assert models_for(table, tenant(GLOBAL_KEY, table)) == ["other-model", MODEL, "us-only"]
    assert models_for(table, tenant(EU_KEY, table)) == [MODEL]
    assert models_for(table, tenant(LIMITED_KEY, table)) == ["other-model"]


def test_bad_or_missing_keys_are_rejected():
    for header in (None, "", "Bearer", "Basic abc", "Bearer mrd_unknown"):
        with pytest.raises(InvalidApiKey) as e:
            authenticate(TABLE, header)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
    assert authenticate(TABLE, f"bearer {EU_KEY}").zone == "eu"


def test_client_location_from_trusted_header_else_default():
    assert locate_client("52.4,4.9", "aws:us-east-1", REGIONS_BY_NAME) == AMSTERDAM
    tokyo = REGIONS["apac"]
    assert locate_client(" onprem:tokyo-1 ", "aws:us-east-1", REGIONS_BY_NAME) == Point(
        tokyo.latitude, tokyo.longitude)
    us = Point(REGIONS["us"].latitude, REGIONS["us"].longitude)
    for garbage in (None, "", "north pole", "91,0", "1,2,3", "aws:nowhere"):
        assert locate_client(garbage, "aws:us-east-1", REGIONS_BY_NAME) == us
    assert locate_client(None, "10,20", REGIONS_BY_NAME) == Point(10, 20)
    # Unknown default and no header: nobody is nearer, load and node id decide.
    assert locate_client(None, "nowhere", REGIONS_BY_NAME) is None
    assert ordered(TABLE, GLOBAL_KEY, None) == ["apac-1", "eu-1", "us-1"]


def test_policies_come_from_a_registry_by_name():
    settings = RouterSettings(cluster_token="t")
    assert isinstance(create_policy("nearest", settings), NearestPolicy)
    with pytest.raises(UnknownName, match="unknown routing policy"):
        create_policy("no-such-policy", settings)

    class Farthest:
        name = "farthest-test"

        def order(self, candidates: Sequence[Candidate], ctx: RoutingContext) -> list[Candidate]:
            return sorted(candidates, key=lambda c: -c.rtt_ms)

    register_policy("farthest-test", lambda _s: Farthest())
    policy = create_policy("farthest-test", settings)
    t = tenant(GLOBAL_KEY)
    cands = select_candidates(TABLE, t, MODEL, fleet(), WASHINGTON)
    ctx = RoutingContext(tenant=t, model=MODEL, stream=False, client_location=WASHINGTON,
                         request_id="r")
    assert [c.node.node_id for c in policy.order(cands, ctx)][0] == "apac-1"


def test_ready_replicas_per_zone_of_each_deployment_that_keeps_replicas():
    """The figure MeridianZoneWithoutReplica alerts on: per zone whose tenants may use a
    deployment, the ready replicas they may use (issue 32: an eu zone without one answers 503)."""
    deployments = [
        DeploymentEntry(model=MODEL, zone="global", min_replicas=1, max_replicas=3),
        DeploymentEntry(model="eu-only", zone="eu", min_replicas=1, max_replicas=3),
        DeploymentEntry(model="cold", zone="global", min_replicas=0, max_replicas=3),
    ]
    nodes = [node("us", "http://us:1"), node("eu", "http://eu:1", status=NodeStatus.STARTING),
             node("apac", "http://apac:1"), node("us", "http://us:2", models=["eu-only"])]
    table = LoadedTable.build(make_table(nodes, deployments=deployments))
    # Tenants: global ones (one limited to "other-model") and an eu one. The eu zone has no
    # ready replica (its node is starting; the us node of "eu-only" is no use to it); a
    # scale-from-zero deployment is not listed.
    assert zone_ready_replicas(table) == {
        ("global", MODEL): 2, ("eu", MODEL): 0, ("global", "eu-only"): 1, ("eu", "eu-only"): 0}

    ready_eu = [*nodes[:1], node("eu", "http://eu:1", models=[MODEL, "eu-only"]), *nodes[2:]]
    table = LoadedTable.build(make_table(ready_eu, deployments=deployments))
    assert zone_ready_replicas(table) == {
        ("global", MODEL): 3, ("eu", MODEL): 1, ("global", "eu-only"): 2, ("eu", "eu-only"): 1}

    # A deployment that may never run where a zone's tenants may be served is not theirs.
    us_only = DeploymentEntry(model=MODEL, zone="us", min_replicas=1, max_replicas=3)
    table = LoadedTable.build(make_table(ready_eu, deployments=[us_only]))
    assert zone_ready_replicas(table) == {("global", MODEL): 3}


# --- the indexes give what a scan of the whole fleet gives ------------------------------------


def _scan_candidates(table: LoadedTable, t: TenantEntry, model: str) -> list[str]:
    """select_candidates as it was before the indexes: a scan of every node, per request."""
    base = model.partition(":")[0]
    serving = [n for n in table.table.nodes if model in n.models]
    if not serving and base != model:
        serving = [n for n in table.table.nodes if base in n.models]
    return [n.node_id for n in serving
            if (r := table.regions.get(n.region)) is not None and r.admits(t.zone) and n.status == NodeStatus.READY]


def _scan_models(table: LoadedTable, t: TenantEntry) -> list[str]:
    served = {m for n in table.table.nodes if n.status == NodeStatus.READY
              and (r := table.regions.get(n.region)) is not None and r.admits(t.zone) for m in n.models}
    return sorted(m for m in served if t.may_use(m))


def test_indexed_selection_matches_a_scan_of_a_large_fleet():
    rng = random.Random(7)
    models = [MODEL, "other-model", "us-only", "llama", "llama:sql", "qwen"]
    statuses = [NodeStatus.READY, NodeStatus.READY, NodeStatus.READY, NodeStatus.STARTING, NodeStatus.DRAINING]
    nodes = [
        node(rng.choice(["us", "eu", "apac"]), f"http://n{i}:1", status=rng.choice(statuses),
             models=rng.sample(models, rng.choice([1, 1, 2]))).model_copy(update={"node_id": f"n-{i:05d}"})
        for i in range(3000)
    ]
    # A node in a region the table does not describe is never a candidate.
    nodes.append(node("us", "http://x:1").model_copy(update={"node_id": "n-unknown", "region": "aws:nowhere-1"}))
    table = LoadedTable.build(make_table(nodes))
    for key in (GLOBAL_KEY, EU_KEY, LIMITED_KEY):
        t = tenant(key, table)
        assert models_for(table, t) == _scan_models(table, t)
        for model in [*models, "llama:other-adapter", "absent"]:
            try:
                got = [c.node.node_id for c in select_candidates(table, t, model, fleet(), WASHINGTON)]
            except (ModelNotFound, NoHealthyReplica, NoReplicaInZone):
                got = []
            expected = _scan_candidates(table, t, model) if t.may_use(model) else []
            # Candidates are unordered (they come grouped by region, nearest first).
            assert sorted(got) == expected, (key, model)
