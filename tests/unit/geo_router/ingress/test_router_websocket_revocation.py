"""A key revoked through the control plane's admin API closes its Responses WebSockets
(issue 33, finding 3), end to end in one event loop: the real control plane (SQLite, its
key store, its routing table) publishes the revocation, the router's table client takes it
by long-poll, and the router closes the key's sockets 1008: a busy one at its next turn
(a warm-up, which never checked the key before), an idle one within ws_key_recheck_s on
the router's clock. Before: the socket stayed open until its idle or age limit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from pydantic import SecretStr
from router_harness import CLUSTER_TOKEN, MODEL, ServerGroup, eventually, router_settings, serve_router

from control_plane.app import create_app as create_control_plane
from geo_router import create_app as create_router
from geo_router.app import RouterState
from meridian.clock import ManualClock
from meridian.security import hash_api_key
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.providers import ProviderSettings

ADMIN_KEY = "mrd_bootstrap-admin-key-for-ws-tests"
KEY_RECHECK_S = 10.0
WARM_UP = {"type": "response.create", "model": MODEL, "input": "context", "generate": False}


@dataclass
class Deployment:
    admin: httpx.AsyncClient
    router: RouterState
    ws_url: str
    clock: ManualClock

    def publishes(self, key: str) -> bool:
        loaded = self.router.table_source.current()
        return loaded is not None and hash_api_key(key) in loaded.tenants

    def connect(self, key: str) -> Any:
        return websockets.connect(self.ws_url, additional_headers={"authorization": f"Bearer {key}"})


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    servers = ServerGroup()
    try:
        cp_settings = ControlPlaneSettings(
            database_url=f"sqlite:///{tmp_path / 'control-plane.db'}", cluster_token=SecretStr(CLUSTER_TOKEN),
            bootstrap_admin_key=SecretStr(ADMIN_KEY), max_long_poll_s=30.0,
            reconciler_enabled=False, autoscaler_enabled=False)
        cp_url = await servers.start(create_control_plane(cp_settings, providers=ProviderSettings(enabled=["onprem"])))
        clock = ManualClock()
        settings = router_settings(control_plane_url=cp_url, table_poll_timeout_s=30.0,
                                   ws_key_recheck_s=KEY_RECHECK_S, probe_interval_s=1e9)
        app = create_router(settings, clock=clock)
        url = (await serve_router(servers, app, settings)).replace("http://", "ws://") + "/v1/responses"
        async with httpx.AsyncClient(base_url=cp_url, timeout=10,
                                     headers={"authorization": f"Bearer {ADMIN_KEY}"}) as admin:
            yield Deployment(admin, app.state.router, url, clock)
    finally:
        await servers.stop()


async def _create_key(admin: httpx.AsyncClient, name: str) -> dict[str, Any]:
    r = await admin.post("/v1/api-keys", json={"name": name, "tenant": "acme", "zone": "global",
                                               "scopes": ["inference"], "create_tenant": name == "first"})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


async def _warm_up(ws: Any) -> dict[str, Any]:
    await ws.send(json.dumps(WARM_UP))
    events = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
    return events[-1]


async def _close_code(ws: Any) -> tuple[list[dict[str, Any]], int | None]:
    """What the router said before closing, and its close code."""
    said = []
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            said.append(json.loads(await asyncio.wait_for(ws.recv(), 5)))
    return said, closed.value.rcvd.code if closed.value.rcvd is not None else None


async def test_a_key_revoked_by_the_admin_api_closes_its_sockets(deployment: Deployment) -> None:
    revoked, other = await _create_key(deployment.admin, "first"), await _create_key(deployment.admin, "second")
    await eventually(lambda: deployment.publishes(revoked["key"]) and deployment.publishes(other["key"]))
    clock = deployment.clock
    loops = clock.sleepers  # the router's own loops asleep on its clock
    async with deployment.connect(revoked["key"]) as idle, deployment.connect(revoked["key"]) as busy, \
            deployment.connect(other["key"]) as unaffected:
        for ws in (idle, busy, unaffected):
            assert (await _warm_up(ws))["type"] == "response.completed"
        await clock.settled(loops + 3)

        r = await deployment.admin.delete(f"/v1/api-keys/{revoked['id']}")
        assert r.status_code == 204, r.text
        await eventually(lambda: not deployment.publishes(revoked["key"]))

        # The next turn, a warm-up, is refused and the socket closed; nothing moved the clock.
        await busy.send(json.dumps(WARM_UP))
        said, code = await _close_code(busy)
        assert [e["error"]["code"] for e in said] == ["invalid_api_key"] and said[0]["status"] == 401
        assert code == 1008

        # The idle socket closes once its key is due to be checked again.
        await clock.settled(loops + 2)
        await clock.advance_async(KEY_RECHECK_S)
        said, code = await _close_code(idle)
        assert code == 1008 and [e["error"]["code"] for e in said] == ["invalid_api_key"]
        # Another key of the same tenant is not touched.
        assert (await _warm_up(unaffected))["type"] == "response.completed"
