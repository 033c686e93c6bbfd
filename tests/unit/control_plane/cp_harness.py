"""Client-side helpers for the control-plane tests (the fixtures are in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from control_plane.errors import PROBLEM_MEDIA_TYPE
from meridian.settings import ControlPlaneSettings

CLUSTER_TOKEN = "test-cluster-token"
ADMIN_KEY = "mrd_bootstrap-admin-key-for-tests"


@dataclass
class ControlPlane:
    app: FastAPI
    http: httpx.AsyncClient
    settings: ControlPlaneSettings

    internal = {"authorization": f"Bearer {CLUSTER_TOKEN}"}
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}

    @staticmethod
    def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
        """The response is an RFC 9457 problem with this status; returns its body."""
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith(PROBLEM_MEDIA_TYPE)
        body: dict[str, Any] = response.json()
        assert body["status"] == status
        assert body["title"]
        assert "Traceback" not in response.text
        return body

    async def register(self, node_id: str, region: str = "aws:us-east-1", **fields: Any) -> httpx.Response:
        body = {
            "node_id": node_id,
            "region": region,
            "url": f"http://{node_id}.test:8000",
            "models": ["tiny-llama"],
            **fields,
        }
        return await self.http.post("/v1/nodes/register", json=body, headers=self.internal)

    async def heartbeat(self, node_id: str, **fields: Any) -> httpx.Response:
        body = {"status": "ready", **fields}
        return await self.http.post(f"/v1/nodes/{node_id}/heartbeat", json=body, headers=self.internal)

    async def table(self, **headers: str) -> httpx.Response:
        return await self.http.get("/v1/routing-table", headers={**self.internal, **headers})

    async def version(self) -> int:
        r = await self.table()
        assert r.status_code == 200
        version: int = r.json()["version"]
        return version

    async def create_key(self, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
        body = {"name": "k", "tenant": "acme", "zone": "eu", "scopes": ["inference"], **fields}
        return await self.http.post("/v1/api-keys", json=body, headers=headers or self.admin)
