"""The kernel's admin client against the real control plane: every call it makes, its typed
answers, and its one error type for problems, invalid requests and an unreachable control plane."""

from __future__ import annotations

import httpx
import pytest
from cp_harness import ADMIN_KEY, ControlPlane

from meridian.admin_api import ApiKeyCreate, DeploymentUpsert, PlanRequest, PlanStatus, Scope
from meridian.admin_client import AdminAPIError, AdminClient, AsyncAdminClient, request_body
from meridian.ports import free_port


def _client(cp: ControlPlane, key: str | None = ADMIN_KEY) -> AsyncAdminClient:
    return AsyncAdminClient("http://cp.test", key, transport=httpx.ASGITransport(app=cp.app))


async def test_keys_are_created_listed_by_tenant_and_revoked(cp: ControlPlane) -> None:
    async with _client(cp) as admin:
        made = await admin.create_key(ApiKeyCreate(name="k1", tenant="acme", zone="eu", scopes=[Scope.INFERENCE],
                                                   models=None, create_tenant=True))
        assert made.key and made.tenant == "acme" and made.zone == "eu" and made.scopes == [Scope.INFERENCE]
        await admin.create_key(ApiKeyCreate(name="other", tenant="zeta", zone="global", scopes=[Scope.INFERENCE],
                                            create_tenant=True))
        assert [k.name for k in await admin.list_keys(tenant="acme")] == ["k1"]
        await admin.revoke_key(made.id)
        assert await admin.list_keys(tenant="acme") == []
        assert [k.id for k in await admin.list_keys(tenant="acme", include_revoked=True)] == [made.id]


class _PagesOfTwo(httpx.AsyncBaseTransport):
    """The control plane, asked for pages of two rows wherever a request names no page size."""

    def __init__(self, app: object) -> None:
        self._app = httpx.ASGITransport(app=app)  # type: ignore[arg-type]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if "limit" not in request.url.params:
            request.url = request.url.copy_add_param("limit", "2")
        return await self._app.handle_async_request(request)


async def test_listings_follow_every_page(cp: ControlPlane) -> None:
    async with AsyncAdminClient("http://cp.test", ADMIN_KEY, transport=_PagesOfTwo(cp.app)) as admin:
        for n in range(5):
            await admin.create_key(ApiKeyCreate(name=f"k{n}", tenant="paged", zone="global", scopes=[Scope.INFERENCE],
                                                create_tenant=True))
        first = await admin._http.get("/v1/api-keys", params={"tenant": "paged"})
        assert "next" in first.links  # the listing does span pages
        assert sorted(k.name for k in await admin.list_keys(tenant="paged")) == [f"k{n}" for n in range(5)]


async def test_deployments_regions_nodes_and_plans_are_typed(cp: ControlPlane) -> None:
    async with _client(cp) as admin:
        d = await admin.put_deployment("org/tiny", DeploymentUpsert(zone="eu", min_replicas=0, max_replicas=2))
        assert (d.model, d.zone, d.max_replicas) == ("org/tiny", "eu", 2)
        assert [x.model for x in await admin.deployments()] == ["org/tiny"]
        regions = await admin.regions()
        assert regions and all(r.zones for r in regions)
        assert await admin.nodes() == []
        plan = await admin.preview_plan(PlanRequest(time_limit_s=5))
        assert plan.status in set(PlanStatus)


async def test_a_refusal_is_one_typed_error_with_the_problem(cp: ControlPlane) -> None:
    async with _client(cp, key="mrd_not-a-key") as admin:
        with pytest.raises(AdminAPIError) as refused:
            await admin.nodes()
    assert refused.value.status == 401 and refused.value.problem and refused.value.title
    async with _client(cp) as admin:
        with pytest.raises(AdminAPIError) as missing:
            await admin.apply_plan("no-such-plan")
    assert missing.value.status == 404 and str(missing.value).startswith("404 ")


def test_an_invalid_request_is_refused_before_it_is_sent_as_the_api_would() -> None:
    with pytest.raises(AdminAPIError) as invalid:
        request_body(ApiKeyCreate, name="k", tenant="no spaces", scopes=["inference"])
    assert invalid.value.status == 422 and str(invalid.value).endswith(": request failed validation")
    assert invalid.value.errors and invalid.value.errors[0]["loc"] == ["tenant"]


def test_an_unreachable_control_plane_is_status_0_with_the_transport_error_as_cause() -> None:
    with AdminClient(f"http://127.0.0.1:{free_port()}", "k", timeout_s=2.0) as admin, \
            pytest.raises(AdminAPIError) as unreachable:
        admin.regions()
    assert unreachable.value.unreachable and isinstance(unreachable.value.__cause__, httpx.TransportError)
    assert "control plane unreachable" in str(unreachable.value)
