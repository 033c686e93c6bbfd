"""The audit log: one entry per change (who, what, before, after), none for a change that did not happen."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from admin_harness import MODEL_SPEC, scoped_key, walk
from cp_harness import ADMIN_KEY, ControlPlane

from control_plane.keystore import BOOTSTRAP_KEY_NAME
from meridian.security import hash_api_key


async def _entries(cp: ControlPlane, **filters: Any) -> list[dict[str, Any]]:
    """Every entry matching the filters, newest first."""
    return [e for page in await walk(cp, "/v1/audit", cp.admin, limit=50, **filters) for e in page]


async def _bootstrap_id(cp: ControlPlane) -> str:
    keys = (await cp.http.get("/v1/api-keys", headers=cp.admin)).json()
    key_id: str = next(k["id"] for k in keys if k["name"] == BOOTSTRAP_KEY_NAME)
    return key_id


def _ok(r: httpx.Response, status: int) -> httpx.Response:
    assert r.status_code == status, r.text
    return r


async def test_every_change_leaves_one_entry(cp: ControlPlane) -> None:
    admin_id = await _bootstrap_id(cp)
    operator, operator_id = await scoped_key(cp, "operator", name="ops-bot")
    h = cp.http

    _ok(await h.post("/v1/tenants", json={"name": "acme", "zone": "eu"}, headers=cp.admin), 201)
    _ok(await h.patch("/v1/tenants/acme", json={"requests_per_minute": 5}, headers=cp.admin), 200)
    key = _ok(await cp.create_key(name="web", tenant="acme", scopes=["inference"]), 201).json()
    _ok(await h.delete(f"/v1/api-keys/{key['id']}", headers=cp.admin), 204)
    _ok(await h.delete("/v1/tenants/acme", headers=cp.admin), 204)
    _ok(await h.put("/v1/models/org/m", json=MODEL_SPEC, headers=operator), 201)
    _ok(await h.put("/v1/models/org/m", json={**MODEL_SPEC, "quantization": "int4"}, headers=operator), 200)
    _ok(await h.put("/v1/deployments/org/m", json={"max_replicas": 2}, headers=operator), 201)
    _ok(await h.put("/v1/deployments/org/m", json={"max_replicas": 4}, headers=operator), 200)
    _ok(await h.delete("/v1/deployments/org/m", headers=operator), 204)
    _ok(await h.delete("/v1/models/org/m", headers=operator), 204)
    _ok(await h.put("/v1/capacity/gcp:europe-west4/L4-24GB", json={"max_gpus": 8}, headers=operator), 201)
    _ok(await h.put("/v1/capacity/gcp:europe-west4/L4-24GB", json={"max_gpus": 4}, headers=operator), 200)
    _ok(await h.delete("/v1/capacity/gcp:europe-west4/L4-24GB", headers=operator), 204)

    entries = list(reversed(await _entries(cp)))
    # The first entries are the set-up's: the "ops" tenant and the operator's key.
    assert [(e["resource_type"], e["action"]) for e in entries[:2]] == [("tenant", "create"), ("api_key", "create")]
    seen = [(e["resource_type"], e["resource_id"], e["action"], e["actor_id"], e["actor_name"]) for e in entries[2:]]
    admin, ops = (admin_id, BOOTSTRAP_KEY_NAME), (operator_id, "ops-bot")
    assert seen == [
        ("tenant", "acme", "create", *admin),
        ("tenant", "acme", "update", *admin),
        ("api_key", key["id"], "create", *admin),
        ("api_key", key["id"], "revoke", *admin),
        ("tenant", "acme", "delete", *admin),
        ("model", "org/m", "create", *ops),
        ("model", "org/m", "update", *ops),
        ("deployment", "org/m", "create", *ops),
        ("deployment", "org/m", "update", *ops),
        ("deployment", "org/m", "delete", *ops),
        ("model", "org/m", "delete", *ops),
        ("capacity", "gcp:europe-west4/L4-24GB", "create", *ops),
        ("capacity", "gcp:europe-west4/L4-24GB", "update", *ops),
        ("capacity", "gcp:europe-west4/L4-24GB", "delete", *ops),
    ]
    by = {(e["resource_type"], e["action"]): e for e in entries[2:]}
    assert by[("tenant", "create")]["before"] is None and by[("tenant", "create")]["after"]["zone"] == "eu"
    update = by[("tenant", "update")]
    assert (update["before"]["requests_per_minute"], update["after"]["requests_per_minute"]) == (None, 5)
    assert by[("tenant", "delete")]["after"] == {"keys_revoked": 0}
    assert by[("api_key", "revoke")]["before"]["revoked_at"] is None
    assert by[("api_key", "revoke")]["after"]["revoked_at"] is not None
    model_update = by[("model", "update")]
    assert (model_update["before"]["quantization"], model_update["after"]["quantization"]) == ("bf16", "int4")
    assert model_update["after"]["resource_version"] == 2
    assert by[("model", "delete")]["after"] is None and by[("model", "delete")]["before"]["name"] == "org/m"
    deployment_update = by[("deployment", "update")]
    assert (deployment_update["before"]["max_replicas"], deployment_update["after"]["max_replicas"]) == (2, 4)
    capacity_update = by[("capacity", "update")]
    assert (capacity_update["before"]["max_gpus"], capacity_update["after"]["max_gpus"]) == (8, 4)
    assert all(e["request_id"] and e["at"] for e in entries)


async def test_changes_that_did_not_happen_leave_no_entry(cp: ControlPlane) -> None:
    h = cp.http
    _ok(await h.put("/v1/models/m", json=MODEL_SPEC, headers=cp.admin), 201)
    _ok(await h.put("/v1/deployments/m", json={}, headers=cp.admin), 201)
    _ok(await h.put("/v1/capacity/aws:us-east-1/L4-24GB", json={"max_gpus": 1}, headers=cp.admin), 201)
    _ok(await h.post("/v1/tenants", json={"name": "acme"}, headers=cp.admin), 201)
    count = len(await _entries(cp))

    stale = {**cp.admin, "if-match": '"9"'}
    _ok(await h.put("/v1/models/m", json={**MODEL_SPEC, "layers": 8}, headers=stale), 412)
    _ok(await h.delete("/v1/models/m", headers=stale), 412)
    _ok(await h.delete("/v1/models/m", headers=cp.admin), 409)  # its deployment holds it
    _ok(await h.put("/v1/deployments/m", json={"max_replicas": 9}, headers=stale), 412)
    _ok(await h.put("/v1/capacity/aws:us-east-1/L4-24GB", json={"max_gpus": 2}, headers=stale), 412)
    _ok(await h.put("/v1/capacity/aws:us-east-1/L4-24GB", json={"max_gpus": 2},
                    headers={**cp.admin, "if-none-match": "*"}), 412)
    _ok(await h.patch("/v1/tenants/acme", json={"zone": "eu"}, headers=stale), 412)
    _ok(await h.post("/v1/tenants", json={"name": "acme"}, headers=cp.admin), 409)
    _ok(await h.patch("/v1/tenants/acme", json={"zone": "atlantis"}, headers=cp.admin), 400)
    _ok(await h.put("/v1/models/m2", json={**MODEL_SPEC, "layers": 0}, headers=cp.admin), 422)
    # The same spec again changes nothing, so it records nothing either.
    _ok(await h.put("/v1/models/m", json=MODEL_SPEC, headers=cp.admin), 200)
    _ok(await h.put("/v1/deployments/m", json={}, headers=cp.admin), 200)
    _ok(await h.put("/v1/capacity/aws:us-east-1/L4-24GB", json={"max_gpus": 1}, headers=cp.admin), 200)
    _ok(await h.patch("/v1/tenants/acme", json={}, headers=cp.admin), 200)

    assert len(await _entries(cp)) == count


async def test_key_entries_hold_neither_the_key_nor_its_hash(cp: ControlPlane) -> None:
    created = [
        _ok(await cp.create_key(name=f"k-{scope}", tenant="acme", scopes=[scope]), 201).json()
        for scope in ("inference", "read-only", "operator", "admin")
    ]
    for key in created:
        _ok(await cp.http.delete(f"/v1/api-keys/{key['id']}", headers=cp.admin), 204)
    entries = await _entries(cp, resource_type="api_key")
    assert len(entries) == 2 * len(created)
    text = str(entries)
    for secret in [k["key"] for k in created] + [ADMIN_KEY]:
        assert secret not in text
        assert hash_api_key(secret) not in text
    assert all("key_hash" not in (e["after"] or {}) and "key" not in (e["after"] or {}) for e in entries)


async def test_filters(cp: ControlPlane) -> None:
    start = datetime.now(UTC) - timedelta(seconds=1)
    operator, operator_id = await scoped_key(cp, "operator")
    _ok(await cp.http.put("/v1/models/a", json=MODEL_SPEC, headers=operator), 201)
    _ok(await cp.http.put("/v1/models/b", json=MODEL_SPEC, headers=cp.admin), 201)

    assert [e["resource_id"] for e in await _entries(cp, resource_type="model")] == ["b", "a"]
    assert [e["resource_id"] for e in await _entries(cp, resource_type="model", resource_id="a")] == ["a"]
    mine = await _entries(cp, actor_id=operator_id)
    assert [(e["resource_type"], e["resource_id"]) for e in mine] == [("model", "a")]
    assert len(await _entries(cp, since=start.isoformat())) == 4  # ops tenant, operator key, a, b
    assert await _entries(cp, since=(datetime.now(UTC) + timedelta(hours=1)).isoformat()) == []
    # Read-only keys may read the log; it holds no secrets.
    reader, _ = await scoped_key(cp, "read-only")
    _ok(await cp.http.get("/v1/audit", headers=reader), 200)
    for bad in ({"since": "yesterday"}, {"since": "2026-01-01T00:00:00"}, {"resource_type": "Model!"}):
        cp.assert_problem(await cp.http.get("/v1/audit", params=bad, headers=cp.admin), 422)
