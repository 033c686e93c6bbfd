"""chaos.scale.measure's KV scope figure: the router that indexes the most nodes."""

from __future__ import annotations

from datetime import UTC, datetime

from chaos.scale.measure import kv_scope_nodes
from geo_router.state.table import LoadedTable
from meridian.contracts import NodeStatus, RegionInfo, RoutingNode, RoutingTable

REGIONS = [
    RegionInfo(name="aws:us-east-1", provider="aws", location="us-east-1", zones=["us"], latitude=38.9, longitude=-77.4),
    RegionInfo(name="aws:us-east-2", provider="aws", location="us-east-2", zones=["us"], latitude=40.0, longitude=-83.0),
    RegionInfo(name="gcp:europe-west4", provider="gcp", location="europe-west4", zones=["eu"],
               latitude=53.4, longitude=6.8),
]


def table(per_region: dict[str, int]) -> LoadedTable:
    nodes = [RoutingNode(node_id=f"{region.split(':')[1]}-{i}", region=region, url=f"http://10.0.0.{i}:1",
                         models=["m"], status=NodeStatus.READY)
             for region, count in per_region.items() for i in range(count)]
    return LoadedTable.build(RoutingTable(version=1, generated_at=datetime.now(UTC), regions=REGIONS, nodes=nodes,
                                          tenants=[]))


def test_the_figure_is_the_router_whose_near_regions_hold_the_most_nodes() -> None:
    # Europe's one region holds more nodes than either US region, fewer than both together.
    loaded = table({"aws:us-east-1": 3, "aws:us-east-2": 3, "gcp:europe-west4": 5})
    assert kv_scope_nodes(loaded, 40.0) == (6, "aws:us-east-1")
    # Within 200 ms every region is near every other: the whole fleet.
    assert kv_scope_nodes(loaded, 200.0)[0] == 11
