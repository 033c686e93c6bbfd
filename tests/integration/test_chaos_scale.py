"""The fleet simulator at a tiny size against the real control plane on Postgres: a killed
node and a drained one leave every router's table (three in-process RoutingTableClients and
a real `meridian router serve`), and a steady fleet keeps its heartbeats without a live node
reaped.

Real processes and real time (the control plane's reaper and the routers' long-polls run in
their own processes): the control plane's TTL and intervals are shortened instead, so that
the test takes about half a minute. The agents run at the normal priority: at a lower one
(the benchmark's) they starved behind the other tests CI runs beside this one, and missed
their heartbeats (7/s reached of 78/s asked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.scale.run import PointSpec, run_point

pytestmark = pytest.mark.postgres

FAST_CONTROL_PLANE = {
    "MERIDIAN_CP_HEARTBEAT_INTERVAL_S": "0.5",
    "MERIDIAN_CP_NODE_TTL_S": "2",
    "MERIDIAN_CP_REAPER_INTERVAL_S": "0.2",
    "MERIDIAN_CP_REAPER_GRACE_S": "0",
}


def test_a_killed_and_a_drained_node_leave_every_routers_table(postgres_server_url: str, tmp_path: Path) -> None:
    spec = PointSpec(nodes=50, regions=3, routers=3, real_routers=1, steady_s=2.0, deaths=2, drains=1,
                     gap_s=0.3, join_per_s=50.0, register_timeout_s=30.0, exclusion_timeout_s=15.0,
                     kv_blocks_per_node=32, cp_env=FAST_CONTROL_PLANE, agent_nice=0,
                     server_url=postgres_server_url, log_dir=tmp_path)

    result = run_point(spec, progress=lambda line: None)

    assert result.collapsed is None, result.collapsed
    fig = result.figures
    # A death or drain counts only once every router (3 in-process + 1 real) excluded the node.
    assert fig["death_to_all_routers_samples"] == 2, result.notes
    assert fig["drain_to_all_routers_samples"] == 1, result.notes
    assert fig["death_to_all_routers_p99_s"] is not None and fig["death_to_all_routers_p99_s"] < 5.0
    # Noticed by the reaper about one TTL after the last heartbeat, not before it.
    assert fig["death_notice_p50_s"] is not None and 1.5 <= fig["death_notice_p50_s"] < 6.0
    assert fig["reaped_live_nodes"] == 0
    assert fig["heartbeats_reached_per_s"] is not None and fig["heartbeats_asked_per_s"] is not None
    assert fig["heartbeats_reached_per_s"] >= 0.7 * fig["heartbeats_asked_per_s"]
    assert fig["table_bytes"] is not None and fig["table_bytes"] > 0
    # The routers' KV scope (50 ms by default) holds at most the fleet, and costs at most its index.
    assert fig["kv_scope_nodes"] is not None and 1 <= fig["kv_scope_nodes"] <= 50
    assert fig["kv_index_scoped_mib"] is not None and fig["kv_index_scoped_mib"] <= fig["kv_index_mib"] * 1.05
