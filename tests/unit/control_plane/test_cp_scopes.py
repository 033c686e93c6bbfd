"""Each scope is denied (403) exactly what it may not do, and allowed the rest; no key or a revoked one is 401.

admin: everything; operator: fleet writes (deployments, models, capacity, placement plans) but
no keys or tenants; read-only: reads only; inference: none of the admin API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from admin_harness import MODEL_SPEC, bearer, scoped_key
from cp_harness import ControlPlane

ADMIN = frozenset({"admin"})
OPERATORS = frozenset({"admin", "operator"})
READERS = frozenset({"admin", "operator", "read-only"})
MISSING_KEY_ID = "00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    allowed: frozenset[str]
    body: dict[str, Any] | None = None
    ok: int = 200  # the status a caller that may make the call gets


# Reads first, then writes, then deletes: a write an allowed scope makes must not break a later call.
CALLS = (
    Call("GET", "/v1/nodes", READERS),
    Call("GET", "/v1/nodes/node-a", READERS),
    Call("GET", "/v1/regions", READERS),
    Call("GET", "/v1/regions/aws:us-east-1", READERS),
    Call("GET", "/v1/zones", READERS),
    Call("GET", "/v1/zones/eu", READERS),
    Call("GET", "/v1/providers", READERS),
    Call("GET", "/v1/providers/aws", READERS),
    Call("GET", "/v1/providers/aws/offerings", READERS),
    Call("GET", "/v1/skus", READERS),
    Call("GET", "/v1/skus/L4-24GB", READERS),
    Call("GET", "/v1/tenants", READERS),
    Call("GET", "/v1/tenants/victim", READERS),
    Call("GET", "/v1/deployments", READERS),
    Call("GET", "/v1/deployments/m1", READERS),
    Call("GET", "/v1/models", READERS),
    Call("GET", "/v1/models/m1", READERS),
    Call("GET", "/v1/models/m1/fit", READERS),
    Call("GET", "/v1/capacity", READERS),
    Call("GET", "/v1/capacity/onprem:tokyo-1/H100-80GB-SXM", READERS),
    Call("GET", "/v1/placement/plans", READERS),
    Call("GET", "/v1/placement/plans/no-such-plan", READERS, ok=404),
    Call("GET", "/v1/placement/current", READERS, ok=404),
    Call("GET", "/v1/audit", READERS),
    Call("GET", "/v1/autoscaler/decisions", READERS),
    Call("GET", "/v1/autoscaler/status", READERS),
    Call("GET", "/v1/reconciler/status", READERS),
    Call("GET", "/v1/console/overview", READERS),
    Call("GET", "/v1/console/drills", READERS),
    Call("GET", "/v1/console/drills/none/report.json", READERS, ok=404),
    Call("GET", "/v1/api-keys", ADMIN),
    Call("GET", f"/v1/api-keys/{MISSING_KEY_ID}", ADMIN, ok=404),
    Call("PUT", "/v1/deployments/m2", OPERATORS, {"max_replicas": 2}, ok=201),
    Call("PUT", "/v1/models/m2", OPERATORS, MODEL_SPEC, ok=201),
    Call("PUT", "/v1/capacity/aws:us-east-1/L4-24GB", OPERATORS, {"max_gpus": 8}, ok=201),
    Call("POST", "/v1/placement/plans", OPERATORS, {"time_limit_s": 5}, ok=201),
    Call("POST", "/v1/placement/plans/no-such-plan/apply", OPERATORS, ok=404),
    Call("POST", "/v1/tenants", ADMIN, {"name": "newco"}, ok=201),
    Call("PATCH", "/v1/tenants/victim", ADMIN, {"requests_per_minute": 10}),
    Call("POST", "/v1/api-keys", ADMIN, {"name": "k", "tenant": "victim", "scopes": ["inference"]}, ok=201),
    Call("DELETE", "/v1/deployments/m1", OPERATORS, ok=204),
    Call("DELETE", "/v1/models/m1", OPERATORS, ok=204),
    Call("DELETE", "/v1/capacity/aws:us-east-1/L4-24GB", OPERATORS, ok=204),
    Call("DELETE", f"/v1/api-keys/{MISSING_KEY_ID}", ADMIN, ok=404),
    Call("DELETE", "/v1/tenants/victim", ADMIN, ok=204),
)


async def _call(cp: ControlPlane, call: Call, headers: dict[str, str]) -> int:
    r = await cp.http.request(call.method, call.path, json=call.body, headers=headers)
    if r.status_code in (401, 403):
        cp.assert_problem(r, r.status_code)
    assert r.status_code < 500, f"{call.method} {call.path}: {r.text}"
    return r.status_code


async def _setup(cp: ControlPlane) -> None:
    """A tenant, a model and its deployment, and a node for the calls to find."""
    assert (await cp.http.post("/v1/tenants", json={"name": "victim"}, headers=cp.admin)).status_code == 201
    assert (await cp.http.put("/v1/models/m1", json=MODEL_SPEC, headers=cp.admin)).status_code == 201
    assert (await cp.http.put("/v1/deployments/m1", json={}, headers=cp.admin)).status_code == 201
    assert (await cp.register("node-a")).status_code == 200


@pytest.mark.parametrize("scope", ["inference", "read-only", "operator", "admin"])
async def test_each_scope_is_denied_exactly_what_it_may_not_do(cp: ControlPlane, scope: str) -> None:
    await _setup(cp)
    headers, _ = await scoped_key(cp, scope)
    wrong = []
    for call in CALLS:
        status = await _call(cp, call, headers)
        if status != (call.ok if scope in call.allowed else 403):
            wrong.append(f"{call.method} {call.path}: {status}")
    assert wrong == [], f"{scope}: allowed/denied wrongly: {wrong}"


async def test_no_key_bad_key_and_revoked_key_are_401(cp: ControlPlane) -> None:
    await _setup(cp)
    headers, key_id = await scoped_key(cp, "admin", name="soon-revoked")
    assert await _call(cp, CALLS[0], headers) == 200
    assert (await cp.http.delete(f"/v1/api-keys/{key_id}", headers=cp.admin)).status_code == 204
    for call in CALLS:
        for sent in ({}, headers, bearer("mrd_not-a-key"), {"authorization": "Basic YWRtaW46YWRtaW4="}):
            assert await _call(cp, call, sent) == 401, f"{call.method} {call.path} with {sent}"


async def test_node_and_router_endpoints_take_the_cluster_token_not_an_api_key(cp: ControlPlane) -> None:
    internal = (
        ("POST", "/v1/nodes/register", {"node_id": "n", "region": "aws:us-east-1", "url": "http://n:1"}),
        ("POST", "/v1/nodes/n/heartbeat", {"status": "ready"}),
        ("DELETE", "/v1/nodes/n", None),
        ("GET", "/v1/routing-table", None),
        ("POST", "/v1/deployments/m/scale-up", {}),
        ("POST", f"/v1/weights/{'0' * 64}/sources", {"node_id": "n"}),
        ("DELETE", f"/v1/weights/{'0' * 64}/nodes/n", None),
    )
    for method, path, body in internal:
        r = await cp.http.request(method, path, json=body, headers=cp.admin)
        cp.assert_problem(r, 401)
