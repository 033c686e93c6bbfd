"""Residency across every layer: for random worlds of regions and zones, each layer that
places, routes, moves or fetches a zone's data admits exactly the regions meridian.residency
admits, so no zoned tenant's data leaves its zone and all layers agree.

The layers: placement (the offerings a deployment may use), the infrastructure plan (the
groups it may provision), routing (a tenant's candidates), a migrating stream's next replica
and a request's prefill/decode pools (both drawn from those candidates), scale-from-zero (the
regions a replica may be started in for a tenant), the autoscaler (the nodes it counts for a
deployment), the weight registry (peers and origins a node may fetch from), the node's own
check of the registry's answer, and the zones a tenant or deployment may be bound to.

Every property runs twice: with the rule as it is, and with another one swapped in
(`_SOVEREIGN`: global data may not go into a region of the "sov" zone). A layer that asks
meridian.residency follows the swapped rule too; one with its own copy of the rule does not,
and fails the second run, even when its copy is exactly today's rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from control_plane import weight_registry
from control_plane.api.tenants import known_zone
from control_plane.autoscaler import in_zone_pools
from control_plane.db.models import Base, Node
from control_plane.errors import BadRequest, Forbidden
from control_plane.placement.problem import Deployment, Problem, ReplicaShape, usable_offerings
from data_plane.weights.errors import ResidencyError
from data_plane.weights.manifest import Manifest, ManifestFile
from data_plane.weights.peers import ControlPlanePeers
from geo_router.errors import NoHealthyReplica, NoReplicaInZone
from geo_router.forwarding.disagg.pools import plan
from geo_router.forwarding.migration.decide import next_replica
from geo_router.selection.candidates import select_candidates
from geo_router.selection.scale_from_zero import placeable_regions
from geo_router.state.health import InProcessFleetState
from geo_router.state.table import LoadedTable
from meridian import residency
from meridian.cluster_client import ClusterClient, ClusterEndpoint
from meridian.contracts import (
    DeploymentEntry,
    KVConnector,
    KVTransferInfo,
    NodeRole,
    NodeStatus,
    RegionInfo,
    RoutingNode,
    RoutingTable,
    TenantEntry,
    WeightSources,
    WeightSourcesRequest,
)
from meridian.infra_plan import GlobalInfra, InfraDeployment, InfraGroup, InfraPlan, InfraRegion
from providers.offerings import Offering

ZONES = ("eu", "us", "apac", "eea", "sov", residency.GLOBAL_ZONE)
MODEL = "m"
DIGEST = "cd" * 32
_REAL = residency.admits


def _sovereign(region_zones: Collection[str], zone: str) -> bool:
    """Another rule: a sovereign region ("sov") holds its own zone's data only, not global data."""
    if zone == residency.GLOBAL_ZONE:
        return "sov" not in region_zones
    return zone in region_zones


RULES = {"as-is": _REAL, "sovereign": _sovereign}


@contextmanager
def _rule(rule: Callable[[Collection[str], str], bool]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(residency, "admits", rule)
        yield


@st.composite
def worlds(draw: st.DrawFn) -> list[RegionInfo]:
    """2 to 5 regions over three providers, each in one zone, some in "eea" as well."""
    count = draw(st.integers(2, 5))
    regions = []
    for i in range(count):
        provider = ("aws", "gcp", "onprem")[i % 3]
        zones = [draw(st.sampled_from(ZONES[:-1]))]
        if zones[0] != "eea" and draw(st.booleans()):
            zones.append("eea")
        regions.append(RegionInfo(name=f"{provider}:r{i}", provider=provider, location=f"r{i}",  # type: ignore[arg-type]
                                  zones=zones, latitude=10.0 * i, longitude=5.0 * i))
    return regions


def admitted(regions: list[RegionInfo], zone: str) -> set[str]:
    """What the rule in force says: the regions that may hold data of `zone`."""
    return {r.name for r in regions if residency.admits(r.zones, zone)}


PROPERTY = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# --- the router: candidates, a stream's next replica, prefill/decode pools, scale-from-zero ---


def _table(regions: list[RegionInfo]) -> LoadedTable:
    transfer = KVTransferInfo(connector=KVConnector.MERIDIAN, endpoint="node:9000", lease_s=30)
    nodes = []
    for r in regions:  # a decode and a prefill worker of the model in every region
        host = r.name.replace(":", "-")
        nodes.append(RoutingNode(node_id=f"{host}-d", region=r.name, url=f"http://{host}-d:1", models=[MODEL],
                                 status=NodeStatus.READY, role=NodeRole.DECODE, kv_transfer=transfer))
        nodes.append(RoutingNode(node_id=f"{host}-p", region=r.name, url=f"http://{host}-p:1", models=[MODEL],
                                 status=NodeStatus.READY, role=NodeRole.PREFILL, kv_transfer=transfer))
    tenants = [TenantEntry(key_hash=f"{i:064x}", key_prefix=f"k{i}", tenant=f"t-{z}", zone=z)
               for i, z in enumerate(ZONES)]
    deployments = [DeploymentEntry(model=f"{MODEL}-{z}", zone=z, min_replicas=0, max_replicas=2) for z in ZONES]
    return LoadedTable.build(RoutingTable(version=1, generated_at=datetime.now(UTC), regions=regions,
                                          nodes=nodes, tenants=tenants, deployments=deployments))


def _router_regions(table: LoadedTable, tenant: TenantEntry) -> dict[str, set[str]]:
    """The regions each router stage may send this tenant's request to."""
    fleet = InProcessFleetState(ejection_base_s=5, ejection_max_s=60)
    try:
        candidates = select_candidates(table, tenant, MODEL, fleet, None)
    except (NoReplicaInZone, NoHealthyReplica):
        candidates = []
    out = {"routing": {c.region.name for c in candidates}}
    pd = plan(candidates)
    out["p/d"] = {c.region.name for c in pd.decode} | {c.region.name for pool in pd.prefill.values() for c in pool}
    # Wherever the stream broke, the replica it moves to (every other one failed in turn).
    moved: set[str] = set()
    for first in candidates:
        failed = {first.node.node_id}
        while (nxt := next_replica(candidates, failed, first.region.name, fleet.is_ejected)) is not None:
            moved.add(nxt.region.name)
            failed.add(nxt.node.node_id)
    out["migration"] = moved | ({c.region.name for c in candidates} if len(candidates) < 2 else set())
    return out


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
@PROPERTY
@given(regions=worlds())
def test_a_tenants_requests_streams_and_pd_pools_stay_in_the_regions_its_zone_admits(
    rule: Callable[[Collection[str], str], bool], regions: list[RegionInfo]
) -> None:
    with _rule(rule):
        table = _table(regions)
        for tenant in table.tenants.values():
            want = admitted(regions, tenant.zone)
            assert _router_regions(table, tenant) == {"routing": want, "p/d": want, "migration": want}, tenant.zone
            for d in table.deployments.values():
                placeable = {r.name for r in placeable_regions(table, tenant, d)}
                assert placeable == want & admitted(regions, d.zone), (tenant.zone, d.zone)


# --- the control plane: placement, the infrastructure plan, the autoscaler, zones --------


def _offerings(regions: list[RegionInfo]) -> list[Offering]:
    return [Offering(r.provider, r.name, "box.x1", "S1", 1, 8, 64, 1.0, None) for r in regions]


def _infra_plan_accepts(region: RegionInfo, zone: str) -> bool:
    try:
        InfraPlan(
            control_plane_url="https://cp.example.com",
            regions=[InfraRegion(name=region.name, provider=region.provider, location=region.location,
                                 zones=list(region.zones)),
                     InfraRegion(name="aws:home", provider="aws", location="home", zones=["us"])],
            deployments=[InfraDeployment(model=MODEL, zone=zone)],
            groups=[InfraGroup(model=MODEL, region=region.name, instance_type="box.x1", sku="S1",
                               gpus_per_instance=1, instances=1, max_instances=1)],
            global_=GlobalInfra(provider="aws", region="aws:home", endpoint_domain="llm.example.com",
                                dns_zone="example.com"),
        )
    except ValidationError as exc:
        assert "residency" in str(exc)
        return False
    return True


def _autoscaler_counts(regions: list[RegionInfo], zone: str) -> set[str]:
    now = datetime.now(UTC)
    nodes = [Node(node_id=f"n{i}", region=r.name, provider=r.provider, url="http://n:1", models=[MODEL],
                  engine="torch", version="1", status="ready", load={"running": 1}, registered_at=now,
                  last_heartbeat=now, role=NodeRole.BOTH.value) for i, r in enumerate(regions)]
    counted: set[str] = set()
    for node in nodes:  # one node at a time: which of them the deployment's pool counts
        if in_zone_pools([node], {MODEL: zone}, {r.name: r for r in regions}):
            counted.add(node.region)
    return counted


def _sovereign_only() -> list[RegionInfo]:
    """Where the swapped rule differs most: every region sovereign, so global data may be nowhere."""
    return [RegionInfo(name=f"{p}:sov{i}", provider=p, location=f"sov{i}", zones=["sov"], latitude=0, longitude=i)  # type: ignore[arg-type]
            for i, p in enumerate(("aws", "onprem"))]


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
@PROPERTY
@given(regions=worlds())
@example(regions=_sovereign_only())
def test_placement_provisioning_and_scaling_keep_a_deployment_in_the_regions_its_zone_admits(
    rule: Callable[[Collection[str], str], bool], regions: list[RegionInfo]
) -> None:
    with _rule(rule):
        problem_regions = {r.name: r for r in regions}
        for zone in ZONES:
            want = admitted(regions, zone)
            # No client regions: no RTT objective narrows the regions, only residency.
            d = Deployment(name=MODEL, shapes={"S1": ReplicaShape(1, 100)}, zone=zone)
            problem = Problem([d], _offerings(regions), problem_regions, {})
            assert {u.region.name for u in usable_offerings(problem, d)} == want, ("placement", zone)
            assert {r.name for r in regions if _infra_plan_accepts(r, zone)} == want, ("infra plan", zone)
            assert _autoscaler_counts(regions, zone) == want, ("autoscaler", zone)
        ctx: Any = SimpleNamespace(regions=problem_regions)
        for zone in ZONES:
            try:
                known = known_zone(ctx, zone) == zone
            except BadRequest:
                known = False
            # A zone a tenant or deployment may be bound to: one whose data some region may hold.
            assert known == any(residency.admits(r.zones, zone) for r in regions), ("zones", zone)


# --- weights: the registry's answer and the node's check of it -------------------------


def _registry_allows(session: Session, regions: list[RegionInfo], node_id: str, zone: str,
                     origin: str | None = None) -> bool:
    req = WeightSourcesRequest(node_id=node_id, zone=zone, origin_region=origin)
    try:
        weight_registry.sources(session, DIGEST, req, {r.name: r for r in regions}, datetime.now(UTC))
    except Forbidden:
        return False
    return True


def _registry_stand_in(region: RegionInfo) -> Starlette:
    """A control plane whose registry let the node through: it answers with the node's zones."""
    answer = WeightSources(node_zones=list(region.zones), peers=[]).model_dump_json()

    async def sources(_request: Request) -> Response:
        return Response(answer, media_type="application/json")

    return Starlette(routes=[Route("/v1/weights/{digest}/sources", sources, methods=["POST"])])


def _node_accepts(region: RegionInfo, zone: str) -> bool:
    """The node's own check of what the registry answered."""
    manifest = Manifest(name=MODEL, zone=zone, created_at=datetime.now(UTC),
                        files=[ManifestFile(path="w.bin", size=1, sha256="0" * 64, chunk_size=4096, chunks=["0" * 64])])

    async def ask() -> None:
        transport = httpx.ASGITransport(app=_registry_stand_in(region))
        async with ClusterClient(ClusterEndpoint("http://cp", None, 5.0), transport=transport) as client:
            await ControlPlanePeers(client, node_id="n", region=region.name).sources(manifest, None)

    try:
        asyncio.run(ask())
    except ResidencyError:
        return False
    return True


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
@PROPERTY
@given(regions=worlds())
def test_weights_of_a_zoned_model_are_fetched_only_in_and_from_the_regions_its_zone_admits(
    rule: Callable[[Collection[str], str], bool], regions: list[RegionInfo]
) -> None:
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    now = datetime.now(UTC)
    with _rule(rule), Session(engine) as session:
        for i, r in enumerate(regions):
            session.add(Node(node_id=f"n{i}", region=r.name, provider=r.provider, url=f"http://n{i}:1",
                             models=[MODEL], engine="torch", version="1", status="ready", load={},
                             registered_at=now, last_heartbeat=now))
        session.flush()
        for zone in ZONES:
            want = admitted(regions, zone)
            where = {r.name for i, r in enumerate(regions) if _registry_allows(session, regions, f"n{i}", zone)}
            assert where == want, ("registry: the asking node's region", zone)
            # From an origin: its region must admit the zone too (the asking node's does here).
            home = next((i for i, r in enumerate(regions) if r.name in want), None)
            if home is not None:
                origins = {r.name for r in regions if _registry_allows(session, regions, f"n{home}", zone, r.name)}
                assert origins == want, ("registry: the origin's region", zone)
            assert {r.name for r in regions if _node_accepts(r, zone)} == want, ("node", zone)
