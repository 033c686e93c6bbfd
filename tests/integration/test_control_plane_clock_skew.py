"""Control-plane replicas whose host clocks disagree: liveness uses the database's clock.

Heartbeats are stamped by the replica that receives them and expired by every replica's
reaper; a replica a minute and a half ahead must not expire nodes another replica just
heard from, and one behind must not keep silent nodes alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from cp_harness import ADMIN_KEY, CLUSTER_TOKEN, ControlPlane
from pydantic import SecretStr

from control_plane.app import create_app
from control_plane.db import clock
from control_plane.db.models import Node
from control_plane.reaper import reap_once
from meridian.settings.control_plane import ControlPlaneSettings

pytestmark = pytest.mark.postgres


def _host_clock_off_by(offset_s: float) -> type[datetime]:
    class Skewed(datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def,override]
            return datetime.now(tz) + timedelta(seconds=offset_s)

    return Skewed


@pytest.fixture
async def cp(postgres_url: str) -> AsyncIterator[ControlPlane]:
    settings = ControlPlaneSettings(
        database_url=postgres_url, cluster_token=SecretStr(CLUSTER_TOKEN), bootstrap_admin_key=SecretStr(ADMIN_KEY),
        node_ttl_s=5.0, reaper_interval_s=3600, reconciler_enabled=False, autoscaler_enabled=False,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            yield ControlPlane(app=app, http=http, settings=settings)


async def _status(cp: ControlPlane, node_id: str) -> str:
    nodes = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()
    return {n["node_id"]: n["status"] for n in nodes}[node_id]


@pytest.mark.parametrize("offset_s", [90.0, -90.0])
async def test_a_replica_with_a_skewed_host_clock_neither_expires_nor_keeps_nodes_wrongly(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch, offset_s: float
) -> None:
    ctx = cp.app.state.ctx
    assert (await cp.register("fresh", status="ready")).status_code == 200
    assert (await cp.register("silent", status="ready")).status_code == 200
    # "silent" last heard from 10 s ago by the database's clock: past its 5 s TTL.
    with ctx.write() as session:
        session.get(Node, "silent").last_heartbeat = clock.db_now(session) - timedelta(seconds=10)

    # This replica's host clock is off; another replica stamped "fresh" a moment ago.
    monkeypatch.setattr(clock, "datetime", _host_clock_off_by(offset_s))
    result = await asyncio.to_thread(reap_once, ctx)
    assert result.lost == ("silent",)
    assert await _status(cp, "fresh") == "ready"
    # A heartbeat handled by the skewed replica is stamped by the database too.
    assert (await cp.heartbeat("fresh")).status_code == 200
    with ctx.read() as session:
        stamped = session.get(Node, "fresh").last_heartbeat
    assert abs((stamped - datetime.now(UTC)).total_seconds()) < 5
