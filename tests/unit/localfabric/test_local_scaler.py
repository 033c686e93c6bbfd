"""The local scaler's decision: a co-located deployment's nodes as before, a disaggregated
deployment's prefill and decode pools each up to its own count, in its role, in one region."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from localfabric.scaling import LocalNode, nodes_to_start, pool_targets
from localfabric.spec import LocalDeployment
from meridian.contracts import DeploymentView, DisaggregationSpec, NodeRole, RegionInfo

NOW = datetime(2026, 11, 28, tzinfo=UTC)
REGIONS = [
    RegionInfo(name="aws:us-east-1", provider="aws", location="us-east-1", zones=["us"], latitude=38.9, longitude=-77.0),
    RegionInfo(name="gcp:europe-west4", provider="gcp", location="europe-west4", zones=["eu"], latitude=53.4,
               longitude=6.8),
    RegionInfo(name="onprem:tokyo-1", provider="onprem", location="tokyo-1", zones=["apac"], latitude=35.7,
               longitude=139.7),
]
OWN = ("aws:us-east-1", "gcp:europe-west4", "onprem:tokyo-1")
EU, US = "gcp:europe-west4", "aws:us-east-1"
PREFILL, DECODE, BOTH = NodeRole.PREFILL, NodeRole.DECODE, NodeRole.BOTH


def view(desired: int, *, prefill: int | None = None, disaggregated: bool = False, **fields: Any) -> DeploymentView:
    values: dict[str, Any] = {
        "model": "m", "zone": "global", "min_replicas": 0, "max_replicas": 8, "desired_replicas": desired,
        "created_at": NOW, "updated_at": NOW, **fields,
    }
    if disaggregated:
        values["disaggregation"] = DisaggregationSpec(min_prefill_replicas=1)
        values["desired_prefill_replicas"] = prefill
    return DeploymentView(**values)


def test_a_co_located_deployment_starts_nodes_up_to_desired_replicas_as_before() -> None:
    assert pool_targets(view(2)) == {BOTH: 2}
    assert nodes_to_start(view(2), [], REGIONS, OWN) == [LocalNode(BOTH, US), LocalNode(BOTH, US)]
    # Every live node of the model counts, whatever its role.
    assert nodes_to_start(view(2), [LocalNode(PREFILL, EU), LocalNode(BOTH, EU)], REGIONS, OWN) == []
    # The region a waiting client asked from, when the zone allows it.
    assert nodes_to_start(view(1, last_scale_region=EU), [], REGIONS, OWN) == [LocalNode(BOTH, EU)]
    assert nodes_to_start(view(1, zone="apac", last_scale_region=EU), [], REGIONS, OWN) == [
        LocalNode(BOTH, "onprem:tokyo-1")
    ]
    # No region of its zone: nothing can start.
    assert nodes_to_start(view(1, zone="mars"), [], REGIONS, OWN) is None
    assert nodes_to_start(view(0, zone="mars"), [], REGIONS, OWN) == []


def test_only_nodes_in_the_deployments_zone_count_as_its_replicas() -> None:
    # An eu deployment whose eu node died: the us and apac nodes of the model serve their own
    # zones' tenants, so an eu node is started.
    others = [LocalNode(BOTH, US), LocalNode(BOTH, "onprem:tokyo-1")]
    assert nodes_to_start(view(1, zone="eu"), others, REGIONS, OWN) == [LocalNode(BOTH, EU)]
    assert nodes_to_start(view(1, zone="eu"), [*others, LocalNode(BOTH, EU)], REGIONS, OWN) == []
    # A global deployment counts them all.
    assert nodes_to_start(view(2), others, REGIONS, OWN) == []


def test_a_disaggregated_deployment_starts_each_pool_in_its_role_up_to_its_own_count() -> None:
    d = view(2, prefill=1, disaggregated=True)
    assert pool_targets(d) == {PREFILL: 1, DECODE: 2}
    assert nodes_to_start(d, [], REGIONS, OWN) == [LocalNode(PREFILL, US), LocalNode(DECODE, US), LocalNode(DECODE, US)]
    # Each pool is counted by its own nodes: a co-located node of the model fills neither.
    assert nodes_to_start(d, [LocalNode(DECODE, US), LocalNode(DECODE, US), LocalNode(BOTH, US)], REGIONS, OWN) == [
        LocalNode(PREFILL, US)
    ]
    # The prefill count the control plane has not set yet: the pool's minimum.
    assert pool_targets(view(1, prefill=None, disaggregated=True)) == {PREFILL: 1, DECODE: 1}
    assert nodes_to_start(view(0, prefill=0, disaggregated=True), [], REGIONS, OWN) == []


def test_a_pools_node_goes_where_the_other_pool_runs() -> None:
    # KV moves only inside a region: the new prefill node joins the decode node in Europe,
    # even though the last scale-up asked from the US.
    d = view(1, prefill=1, disaggregated=True, last_scale_region=US)
    assert nodes_to_start(d, [LocalNode(DECODE, EU)], REGIONS, OWN) == [LocalNode(PREFILL, EU)]
    # A partner outside the zone is no place for it, nor does it count towards its pool: both
    # pools are started in the zone.
    d = view(1, prefill=2, disaggregated=True, zone="us")
    assert nodes_to_start(d, [LocalNode(DECODE, EU), LocalNode(PREFILL, EU)], REGIONS, OWN) == [
        LocalNode(PREFILL, US), LocalNode(PREFILL, US), LocalNode(DECODE, US)]
    # Nodes planned in one decision stay together too.
    d = view(2, prefill=1, disaggregated=True, zone="eu")
    assert nodes_to_start(d, [], REGIONS, OWN) == [LocalNode(PREFILL, EU), LocalNode(DECODE, EU), LocalNode(DECODE, EU)]


def test_a_local_deployment_declares_its_disaggregation_in_the_put_that_creates_it() -> None:
    spec = DisaggregationSpec(prefill_per_decode=0.5, min_prefill_replicas=1, max_prefill_replicas=2)
    body = LocalDeployment("m", min_replicas=1, max_replicas=2, disaggregation=spec).upsert()
    assert body.disaggregation == spec and (body.min_replicas, body.max_replicas) == (1, 2)
    assert LocalDeployment("m").upsert().disaggregation is None
