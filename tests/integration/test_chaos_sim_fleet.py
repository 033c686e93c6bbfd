"""A drill's simulated fleet (chaos.sim_fleet) against the real control plane on Postgres: its
nodes register over the catalog's regions, are READY in the routing table a router fetches,
serve none of the drill's model, answer a router's health probe on their own URL, and
stop with the fleet's process."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import httpx
import pytest

from chaos.scale.stack import scratch_database, start_control_plane
from chaos.sim_fleet import SimulatedFleet
from localfabric import DEMO_MODEL
from meridian.contracts import NodeStatus, RoutingTable

pytestmark = pytest.mark.postgres


def test_a_simulated_fleet_registers_answers_probes_and_stops(postgres_server_url: str, tmp_path: Path) -> None:
    token = secrets.token_urlsafe(16)
    with scratch_database(postgres_server_url) as database_url:
        cp = start_control_plane(database_url, token, tmp_path)
        try:
            asyncio.run(_exercise(cp.url, token))
        finally:
            cp.stop()


async def _exercise(cp_url: str, token: str) -> None:
    auth = {"authorization": f"Bearer {token}"}
    fleet = await SimulatedFleet.start(cp_url, token, 12)
    try:
        async with httpx.AsyncClient(timeout=5.0, headers=auth) as http:
            table = RoutingTable.model_validate_json((await http.get(f"{cp_url}/v1/routing-table")).content)
            ready = [n for n in table.nodes if n.status == NodeStatus.READY]
            assert len(ready) == 12
            assert len({n.region for n in ready}) == min(12, len(table.regions))
            assert all(DEMO_MODEL not in n.models for n in ready)
            # What a router's active probe asks each of them, on its own address.
            assert len({n.url for n in ready}) == 12
            answers = await asyncio.gather(*(http.get(f"{n.url}/metrics") for n in ready))
            assert [a.status_code for a in answers] == [200] * 12
        assert fleet.stats is not None and fleet.stats.reregistrations == 0
    finally:
        await fleet.stop()
    assert fleet.process.exitcode is not None
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(timeout=2.0) as http:
            await http.get(f"{ready[0].url}/metrics")
