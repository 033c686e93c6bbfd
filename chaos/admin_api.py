"""The control plane's admin API as a drill uses it: a key per drill tenant, the regions'
residency zones, the nodes a fault may target. The same calls for a local fabric and a
deployment, over the kernel's admin client (`meridian.admin_client`); its errors become
`AdminApiError`s that say which drill step failed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

from chaos.drill import TenantLoad
from meridian.admin_api import ApiKeyCreate, ApiKeyView, Scope
from meridian.admin_client import AdminAPIError, AsyncAdminClient
from meridian.contracts import NodeView


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

    def client(self) -> AsyncAdminClient:
        """A client of the control plane with the admin key (close it: `async with`)."""
        return AsyncAdminClient(self.url, self.admin_key, self.timeout_s)

    async def create_tenant_keys(self, tenants: Sequence[TenantLoad], name: str = "chaos") -> dict[str, TenantKey]:
        """One inference key per drill tenant, in its residency zone, named `<name>-<tenant>`."""
        return {t.name: await self.create_tenant_key(t, name) for t in tenants}

    async def create_tenant_key(self, tenant: TenantLoad, name: str = "chaos") -> TenantKey:
        """An inference key for a drill tenant, in its residency zone, named `<name>-<tenant>`."""
        body = ApiKeyCreate(name=f"{name}-{tenant.name}", tenant=tenant.name, zone=tenant.zone,
                            scopes=[Scope.INFERENCE], models=None, create_tenant=True)
        async with self._admin(f"creating the key of tenant {tenant.name}") as admin:
            made = await admin.create_key(body)
        return TenantKey(key_id=made.id, secret=made.key)

    async def revoke_keys(self, key_ids: Iterable[str]) -> list[str]:
        """Revoke the keys; the ids that could not be revoked (already gone counts as revoked)."""
        failed = []
        async with self.client() as admin:
            for key_id in key_ids:
                try:
                    await admin.revoke_key(key_id)
                except AdminAPIError as e:
                    if e.status != 404:
                        failed.append(key_id)
        return failed

    async def region_zones(self) -> dict[str, list[str]]:
        """Each region's residency zones."""
        async with self._admin("GET /v1/regions") as admin:
            return {r.name: list(r.zones) for r in await admin.regions()}

    async def api_keys(self, tenant: str) -> list[ApiKeyView]:
        """The tenant's live keys, across pages."""
        async with self._admin("GET /v1/api-keys") as admin:
            return await admin.list_keys(tenant=tenant)

    async def nodes(self) -> list[NodeView]:
        """Every node the control plane knows, across pages."""
        async with self._admin("GET /v1/nodes") as admin:
            return await admin.nodes()

    @contextlib.asynccontextmanager
    async def _admin(self, what: str) -> AsyncIterator[AsyncAdminClient]:
        """A client whose errors become AdminApiError("<what> failed: <status title: detail>")."""
        try:
            async with self.client() as admin:
                yield admin
        except AdminAPIError as e:
            raise AdminApiError(f"{what} failed: {e}") from e
