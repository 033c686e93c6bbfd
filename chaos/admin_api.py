"""The control plane's admin API as a drill uses it: a key per drill tenant, the regions'
residency zones, the nodes a fault may target. The same calls for a local fabric and a
deployment."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from chaos.drill import TenantLoad


class AdminApiError(RuntimeError):
    """The control plane refused or failed an admin call a drill needs."""


@dataclass(frozen=True, slots=True)
class TenantKey:
    """A key made for one drill tenant: its id (to revoke it) and its secret."""

    key_id: str
    secret: str


@dataclass(frozen=True)
class AdminApi:
    """Calls on one control plane with an admin key; every call bounded by `timeout_s`."""

    url: str
    admin_key: str
    timeout_s: float = 10.0

    def client(self) -> httpx.AsyncClient:
        """A client of the control plane with the admin key (close it: `async with`)."""
        return httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s,
                                 headers={"authorization": f"Bearer {self.admin_key}"})

    async def create_tenant_keys(self, tenants: Sequence[TenantLoad], name: str = "chaos") -> dict[str, TenantKey]:
        """One inference key per drill tenant, in its residency zone, named `<name>-<tenant>`."""
        return {t.name: await self.create_tenant_key(t, name) for t in tenants}

    async def create_tenant_key(self, tenant: TenantLoad, name: str = "chaos") -> TenantKey:
        """An inference key for a drill tenant, in its residency zone, named `<name>-<tenant>`."""
        async with self.client() as http:
            r = await http.post("/v1/api-keys", json={
                "name": f"{name}-{tenant.name}", "tenant": tenant.name, "zone": tenant.zone,
                "scopes": ["inference"], "models": None,
            })
        if r.status_code != 201:
            raise AdminApiError(f"creating the key of tenant {tenant.name} failed: {r.status_code} {r.text[:300]}")
        body = r.json()
        return TenantKey(key_id=body["id"], secret=body["key"])

    async def revoke_keys(self, key_ids: Iterable[str]) -> list[str]:
        """Revoke the keys; the ids that could not be revoked (already gone counts as revoked)."""
        failed = []
        async with self.client() as http:
            for key_id in key_ids:
                try:
                    r = await http.delete(f"/v1/api-keys/{key_id}")
                    if r.status_code not in (204, 404):
                        failed.append(key_id)
                except httpx.HTTPError:
                    failed.append(key_id)
        return failed

    async def region_zones(self) -> dict[str, list[str]]:
        """Each region's residency zones."""
        return {x["name"]: list(x["zones"]) for x in await self._all("/v1/regions")}

    async def api_keys(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's live keys (ApiKeyView as JSON), across pages."""
        return await self._all(f"/v1/api-keys?tenant={tenant}")

    async def nodes(self) -> list[dict[str, Any]]:
        """Every node the control plane knows (NodeView as JSON), across pages."""
        return await self._all("/v1/nodes")

    async def _all(self, path: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        url: str | None = path
        async with self.client() as http:
            while url is not None:
                r = await http.get(url)
                if r.status_code != 200:
                    raise AdminApiError(f"GET {path} failed: {r.status_code} {r.text[:300]}")
                out += r.json()
                url = r.links.get("next", {}).get("url")
        return out
