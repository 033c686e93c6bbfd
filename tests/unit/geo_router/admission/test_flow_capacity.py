"""A flow-control pool's capacity: the batch slots of the ready replicas the zone may use (an
ejected one and another zone's not counted), the default for a node that registered none,
and other routers' requests as the nodes report them beyond this router's own."""

from __future__ import annotations

from router_harness import MODEL, make_table, node

from geo_router.admission.flow_capacity import CACHE_S, pool_capacity
from geo_router.admission.flow_control import Peers
from geo_router.state.health import InProcessFleetState
from geo_router.state.node_load import NodeLoad
from geo_router.state.table import LoadedTable
from meridian.clock import ManualClock
from meridian.contracts import NodeStatus
from meridian.settings.router import RouterSettings

SETTINGS = RouterSettings(cluster_token="t", flow_default_slots=32, max_ejected_percent=100)


def _build() -> LoadedTable:
    nodes = [
        node("eu", "http://eu-1:8000").model_copy(update={"max_num_seqs": 8}),
        node("eu", "http://eu-2:8000").model_copy(update={"node_id": "eu-2", "max_num_seqs": 4}),
        node("eu", "http://eu-3:8000").model_copy(update={"node_id": "eu-3", "status": NodeStatus.STARTING}),
        node("us", "http://us-1:8000"),  # registered no slots: the default
    ]
    return LoadedTable.build(make_table(nodes))


TABLE = _build()


def _table() -> LoadedTable:
    return TABLE


def test_the_zone_counts_its_own_ready_replicas_slots_and_global_counts_every_region() -> None:
    fleet = InProcessFleetState.from_settings(SETTINGS)
    capacity = pool_capacity(SETTINGS, _table, fleet, lambda _n: None, ManualClock())
    assert capacity(("eu", MODEL)).slots == 12
    assert capacity(("us", MODEL)).slots == 32
    assert capacity(("global", MODEL)).slots == 44
    assert capacity(("eu", "other-model")).slots == 0
    assert pool_capacity(SETTINGS, lambda: None, fleet, lambda _n: None, ManualClock())(("eu", MODEL)).slots == 0


def test_an_ejected_replica_takes_its_slots_out() -> None:
    fleet = InProcessFleetState.from_settings(SETTINGS)
    fleet.set_known_nodes(["eu-1", "eu-2", "us-1"])
    fleet.record_failure("eu-2")
    assert pool_capacity(SETTINGS, _table, fleet, lambda _n: None, ManualClock())(("eu", MODEL)).slots == 8


def test_other_routers_requests_are_the_reports_beyond_this_routers_own_summed_over_the_pool() -> None:
    fleet = InProcessFleetState.from_settings(SETTINGS)
    loads = {
        "eu-1": NodeLoad(running=8, waiting=2, own_in_flight=6),  # 4 of another router's
        "eu-2": NodeLoad(running=1, waiting=0, own_in_flight=2),  # one of ours already ended there
    }
    clock = ManualClock()
    capacity = pool_capacity(SETTINGS, _table, fleet, loads.get, clock)
    assert capacity(("eu", MODEL)).others == 3
    loads["eu-1"] = NodeLoad(running=5, own_in_flight=6)
    assert capacity(("eu", MODEL)).others == 3  # measured a moment ago: kept
    clock.advance(CACHE_S)
    assert capacity(("eu", MODEL)).others == 0  # never below nothing


def test_the_other_routers_as_they_published_themselves_replace_the_reports_while_fresh() -> None:
    fleet = InProcessFleetState.from_settings(SETTINGS)
    loads = {"eu-1": NodeLoad(running=8, waiting=2, own_in_flight=6)}
    peers = Peers(others=5, others_demand=(30,), own_demand=10)
    published: dict[tuple[str, str], Peers] = {("eu", MODEL): peers}
    clock = ManualClock()
    capacity = pool_capacity(SETTINGS, _table, fleet, loads.get, clock, published.get)
    got = capacity(("eu", MODEL))
    assert (got.others, got.peers) == (5, peers)
    published.clear()  # the view lapsed (Redis unreachable): the nodes' reports again
    clock.advance(CACHE_S)
    got = capacity(("eu", MODEL))
    assert (got.others, got.peers) == (4, None)
