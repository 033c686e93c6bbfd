"""The control plane's Postgres goes away and comes back: the admin API answers a clean
503 with Retry-After meanwhile, reconnects by itself, and keeps every write it acknowledged.

The control plane runs on a ManualClock: its reaper passes when the test moves it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from cp_harness import ADMIN_KEY, CLUSTER_TOKEN, REAPER, ControlPlane, advance, until
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from chaos.faults import FaultProxy
from control_plane.app import create_app
from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node
from meridian.clock import ManualClock
from meridian.settings.control_plane import ControlPlaneSettings

pytestmark = pytest.mark.postgres


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def proxied(
    postgres_url: str, settings_overrides: dict[str, Any], clock: ManualClock
) -> AsyncIterator[tuple[ControlPlane, FaultProxy]]:
    """A control plane whose database connections pass through a fault proxy."""
    url = make_url(postgres_url)
    async with FaultProxy("127.0.0.1", 0, url.host or "127.0.0.1", url.port or 5432) as proxy:
        settings = ControlPlaneSettings(
            database_url=url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False),
            cluster_token=SecretStr(CLUSTER_TOKEN), bootstrap_admin_key=SecretStr(ADMIN_KEY),
            reconciler_enabled=False, autoscaler_enabled=False, **settings_overrides,
        )
        app = create_app(settings, clock=clock)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
                yield ControlPlane(app=app, http=http, settings=settings), proxy


async def test_admin_writes_during_a_database_outage_are_clean_503s_and_acknowledged_ones_survive(
    proxied: tuple[ControlPlane, FaultProxy],
) -> None:
    cp, proxy = proxied
    before = await cp.create_key(name="before", tenant="outage")
    assert before.status_code == 201

    proxy.reset(1.0)  # every pooled connection cut, new ones reset: a restart as clients see it
    during = await cp.create_key(name="during", tenant="outage")
    body = cp.assert_problem(during, 503)
    assert "retry" in body["detail"] and during.headers["retry-after"] == "2"
    assert "Traceback" not in during.text

    proxy.heal()
    after = await cp.create_key(name="after", tenant="outage")
    assert after.status_code == 201, after.text
    keys = (await cp.http.get("/v1/api-keys", params={"tenant": "outage"}, headers=cp.admin)).json()
    assert {k["name"] for k in keys} == {"before", "after"}


@pytest.mark.parametrize("settings_overrides", [{"node_ttl_s": 1.0, "reaper_interval_s": 0.1}])
async def test_healthy_nodes_are_not_expired_when_the_database_comes_back_from_an_outage(
    proxied: tuple[ControlPlane, FaultProxy], clock: ManualClock
) -> None:
    """No heartbeat could be recorded while the database was away: that is not the nodes' silence."""
    cp, proxy = proxied
    interval = cp.settings.reaper_interval_s
    assert (await cp.register("n1", status="ready")).status_code == 200
    await until(lambda: clock.sleepers >= REAPER)
    proxy.reset(1.0)
    await advance(clock, interval, sleepers=REAPER)  # a reaper pass that finds the database gone
    cp.assert_problem(await cp.heartbeat("n1"), 503)
    proxy.heal()
    # The outage outlasted the TTL: the node's last heartbeat is 2.5 s old by the database's clock.
    ctx: AppContext = cp.app.state.ctx

    def silent_through_the_outage() -> None:
        with ctx.write() as session:
            node = session.get(Node, "n1")
            assert node is not None
            node.last_heartbeat = db_now(session) - timedelta(seconds=2.5)

    # In a thread: the proxy serves the database's connections on this event loop.
    await asyncio.to_thread(silent_through_the_outage)
    for _ in range(10):  # several reaper passes on a reachable database
        await advance(clock, interval, sleepers=REAPER)
    nodes = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()
    assert {n["node_id"]: n["status"] for n in nodes} == {"n1": "ready"}
    assert (await cp.heartbeat("n1")).status_code == 200
