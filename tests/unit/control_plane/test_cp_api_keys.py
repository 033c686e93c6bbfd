"""API keys: shown once, stored as hashes, scoped, and published to routers as tenants."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from cp_harness import ADMIN_KEY, ControlPlane

from control_plane.db.engine import make_engine
from meridian.contracts import TenantEntry
from meridian.security import hash_api_key


def _api_key_rows(cp: ControlPlane) -> list[dict[str, object]]:
    engine = make_engine(cp.settings.database_url)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM api_keys"))]
    finally:
        engine.dispose()


async def test_created_key_is_shown_once_and_stored_as_a_hash(cp: ControlPlane) -> None:
    r = await cp.create_key(name="web", tenant="acme", zone="eu", scopes=["inference"], models=["tiny-llama"])
    assert r.status_code == 201
    created = r.json()
    key = created["key"]
    assert key.startswith("mrd_")
    assert key.startswith(created["key_prefix"])
    assert created["zone"] == "eu"
    assert created["models"] == ["tiny-llama"]

    listed = (await cp.http.get("/v1/api-keys", headers=cp.admin)).json()
    mine = [k for k in listed if k["id"] == created["id"]]
    assert len(mine) == 1
    assert "key" not in mine[0]
    assert key not in str(listed)

    rows = _api_key_rows(cp)
    assert all(key not in str(row) for row in rows)
    assert all(ADMIN_KEY not in str(row) for row in rows)
    assert {row["key_hash"] for row in rows} == {hash_api_key(key), hash_api_key(ADMIN_KEY)}


async def test_inference_keys_are_published_as_tenants_until_revoked(cp: ControlPlane) -> None:
    v = await cp.version()
    created = (await cp.create_key(tenant="acme", zone="eu", scopes=["inference"])).json()
    table = (await cp.table()).json()
    assert table["version"] == v + 1
    assert table["tenants"] == [
        {
            "key_hash": hash_api_key(created["key"]),
            "key_prefix": created["key_prefix"],
            "tenant": "acme",
            "zone": "eu",
            "models": None,
            "requests_per_minute": None,
            "tokens_per_minute": None,
        }
    ]

    r = await cp.http.delete(f"/v1/api-keys/{created['id']}", headers=cp.admin)
    assert r.status_code == 204
    table = (await cp.table()).json()
    assert table["tenants"] == []
    assert table["version"] == v + 2
    listed = (await cp.http.get("/v1/api-keys", headers=cp.admin)).json()
    assert created["id"] not in {k["id"] for k in listed}
    listed = (await cp.http.get("/v1/api-keys?include_revoked=true", headers=cp.admin)).json()
    assert [k["revoked_at"] is not None for k in listed if k["id"] == created["id"]] == [True]

    cp.assert_problem(await cp.http.delete("/v1/api-keys/no-such-key", headers=cp.admin), 404)


async def test_admin_only_keys_are_not_tenants(cp: ControlPlane) -> None:
    await cp.create_key(scopes=["operator"])
    assert (await cp.table()).json()["tenants"] == []


async def test_scopes_are_enforced(cp: ControlPlane) -> None:
    reader = (await cp.create_key(name="ro", scopes=["read-only"])).json()["key"]
    inference = (await cp.create_key(name="app", scopes=["inference"])).json()["key"]
    as_reader = {"authorization": f"Bearer {reader}"}
    as_inference = {"authorization": f"Bearer {inference}"}

    assert (await cp.http.get("/v1/nodes", headers=as_reader)).status_code == 200
    regions = await cp.http.get("/v1/regions", headers=as_reader)
    assert regions.status_code == 200
    assert "onprem:tokyo-1" in {r["name"] for r in regions.json()}

    body = cp.assert_problem(await cp.create_key(headers=as_reader), 403)
    assert "admin" in body["detail"]
    cp.assert_problem(await cp.http.get("/v1/api-keys", headers=as_reader), 403)
    cp.assert_problem(await cp.http.get("/v1/nodes", headers=as_inference), 403)

    cp.assert_problem(await cp.http.get("/v1/nodes"), 401)
    cp.assert_problem(await cp.http.get("/v1/nodes", headers={"authorization": "Bearer mrd_nope"}), 401)
    # The cluster token is not an API key.
    cp.assert_problem(await cp.http.get("/v1/nodes", headers=cp.internal), 401)


async def test_revoked_key_no_longer_authenticates(cp: ControlPlane) -> None:
    created = (await cp.create_key(scopes=["admin"])).json()
    as_new_admin = {"authorization": f"Bearer {created['key']}"}
    assert (await cp.http.get("/v1/api-keys", headers=as_new_admin)).status_code == 200
    await cp.http.delete(f"/v1/api-keys/{created['id']}", headers=cp.admin)
    cp.assert_problem(await cp.http.get("/v1/api-keys", headers=as_new_admin), 401)


async def test_invalid_key_requests(cp: ControlPlane) -> None:
    body = cp.assert_problem(await cp.create_key(zone="mars"), 400)
    assert "mars" in body["detail"]
    body = cp.assert_problem(await cp.create_key(scopes=["superuser"]), 422)
    assert body["errors"][0]["loc"][:2] == ["body", "scopes"]
    cp.assert_problem(await cp.create_key(scopes=[]), 422)


async def test_a_key_name_with_control_characters_is_refused(cp: ControlPlane) -> None:
    before = (await cp.http.get("/v1/api-keys", headers=cp.admin)).json()
    for name in ("web\r\nX-Forged: 1", "tab\there", "nul\x00"):
        cp.assert_problem(await cp.create_key(name=name), 422)
    assert (await cp.http.get("/v1/api-keys", headers=cp.admin)).json() == before


async def test_a_keys_models_never_outlive_its_tenants(cp: ControlPlane) -> None:
    """Issue 18, finding 2: the key's own list used to be published as is."""
    assert (await cp.http.post("/v1/tenants", json={"name": "acme", "zone": "eu", "models": ["tiny-llama", "big"]},
                               headers=cp.admin)).status_code == 201
    narrow = (await cp.create_key(tenant="acme", zone="eu", models=["tiny-llama"])).json()
    adapter = (await cp.create_key(tenant="acme", zone="eu", models=["big:support"])).json()
    wide = (await cp.create_key(tenant="acme", zone="eu")).json()

    def published(table: dict[str, object]) -> dict[str, object]:
        return {t["key_hash"]: t["models"] for t in table["tenants"]}  # type: ignore[index, union-attr]

    table = published((await cp.table()).json())
    assert table[hash_api_key(narrow["key"])] == ["tiny-llama"]
    assert table[hash_api_key(adapter["key"])] == ["big:support"]
    assert table[hash_api_key(wide["key"])] == ["tiny-llama", "big"]

    r = await cp.http.patch("/v1/tenants/acme", json={"models": ["other-model", "big"]}, headers=cp.admin)
    assert r.status_code == 200, r.text
    table = published((await cp.table()).json())
    assert table[hash_api_key(narrow["key"])] == []
    assert table[hash_api_key(adapter["key"])] == ["big:support"]
    assert table[hash_api_key(wide["key"])] == ["other-model", "big"]


async def test_a_tenants_zone_change_reaches_every_key_and_the_routing_table_at_once(cp: ControlPlane) -> None:
    """The zone is stored once, on the tenant (migration 0014): its keys and their routing
    entries read it there, so no key can be left in the old zone."""
    keys = [(await cp.create_key(tenant="acme", zone="eu", name=f"k{i}")).json() for i in range(3)]
    other = (await cp.create_key(tenant="globex", zone="us")).json()
    version = await cp.version()

    r = await cp.http.patch("/v1/tenants/acme", json={"zone": "us"}, headers=cp.admin)
    assert r.status_code == 200 and r.json()["zone"] == "us", r.text
    listed = {k["id"]: k["zone"] for k in await cp.admin_list("/v1/api-keys")}
    assert [listed[k["id"]] for k in keys] == ["us", "us", "us"] and listed[other["id"]] == "us"
    table = (await cp.table()).json()
    assert table["version"] > version
    zones = {t["key_hash"]: t["zone"] for t in table["tenants"]}
    assert [zones[hash_api_key(k["key"])] for k in keys] == ["us", "us", "us"]

    # And back: one write, every key follows; the other tenant's key stays where it was.
    assert (await cp.http.patch("/v1/tenants/acme", json={"zone": "eu"}, headers=cp.admin)).status_code == 200
    zones = {t["key_hash"]: t["zone"] for t in (await cp.table()).json()["tenants"]}
    assert [zones[hash_api_key(k["key"])] for k in keys] == ["eu", "eu", "eu"]
    assert zones[hash_api_key(other["key"])] == "us"


async def test_a_deleted_tenants_revoked_keys_are_listed_without_a_zone_not_as_global(cp: ControlPlane) -> None:
    """A key's zone is its tenant's (stored there alone): once the tenant is gone, the zone
    is unknown, never guessed as global."""
    key = (await cp.create_key(tenant="acme", zone="eu")).json()
    assert (await cp.http.delete("/v1/tenants/acme", headers=cp.admin)).status_code in (200, 204)
    listed = {k["id"]: k for k in await cp.admin_list("/v1/api-keys", include_revoked="true")}
    assert listed[key["id"]]["revoked_at"] is not None and listed[key["id"]]["zone"] is None
    assert all(t["key_hash"] != hash_api_key(key["key"]) for t in (await cp.table()).json()["tenants"])


async def test_a_tenants_cache_sharing_group_is_published_with_its_keys(cp: ControlPlane) -> None:
    r = await cp.http.post("/v1/tenants", json={"name": "team-a", "zone": "eu", "cache_group": "acme-corp"},
                           headers=cp.admin)
    assert r.status_code == 201 and r.json()["cache_group"] == "acme-corp"
    key = (await cp.create_key(tenant="team-a", zone="eu")).json()
    [entry] = (await cp.table()).json()["tenants"]
    assert entry["key_hash"] == hash_api_key(key["key"]) and entry["cache_group"] == "acme-corp"
    # Back to a cache of its own.
    assert (await cp.http.patch("/v1/tenants/team-a", json={"cache_group": None}, headers=cp.admin)).status_code == 200
    [entry] = (await cp.table()).json()["tenants"]
    assert "cache_group" not in entry
    bad = await cp.http.post("/v1/tenants", json={"name": "b", "cache_group": "no spaces\n"}, headers=cp.admin)
    cp.assert_problem(bad, 422)


async def test_a_tenants_priority_and_weight_are_published_with_its_keys_and_a_keys_own_priority_wins(
    cp: ControlPlane,
) -> None:
    """Flow control (issue 37): each entry carries its key's band (its own, else its tenant's)
    and its tenant's weight; at their defaults they are left out, as older routers expect."""
    r = await cp.http.post("/v1/tenants", json={"name": "team-a", "zone": "eu", "priority": 3, "weight": 2},
                           headers=cp.admin)
    assert r.status_code == 201, r.text
    inherits = (await cp.create_key(tenant="team-a", name="inherits")).json()
    batch = (await cp.create_key(tenant="team-a", name="batch", priority=-5)).json()
    # An override to the default band still wins over the tenant's.
    level = (await cp.create_key(tenant="team-a", name="level", priority=0)).json()
    assert (inherits["priority"], batch["priority"], level["priority"]) == (None, -5, 0)
    listed = {k["name"]: k["priority"] for k in await cp.admin_list("/v1/api-keys", tenant="team-a")}
    assert listed == {"inherits": None, "batch": -5, "level": 0}

    def published(table: dict[str, Any]) -> dict[str, dict[str, Any]]:
        entries = {t["key_hash"]: t for t in table["tenants"]}
        return {k["name"]: entries[hash_api_key(k["key"])] for k in (inherits, batch, level)}

    entries = published((await cp.table()).json())
    assert [(e.get("priority"), e.get("weight")) for e in entries.values()] == [(3, 2.0), (-5, 2.0), (None, 2.0)]
    assert TenantEntry.model_validate(entries["batch"]).sheddable
    assert not TenantEntry.model_validate(entries["inherits"]).sheddable

    # The tenant back at the defaults: the keys that follow it carry neither field.
    version = await cp.version()
    r = await cp.http.patch("/v1/tenants/team-a", json={"priority": 0, "weight": 1}, headers=cp.admin)
    assert r.status_code == 200, r.text
    table = (await cp.table()).json()
    assert table["version"] > version
    entries = published(table)
    assert "priority" not in entries["inherits"] and "weight" not in entries["inherits"]
    assert entries["batch"]["priority"] == -5 and "weight" not in entries["batch"]

    for bad in (11, -11, "high"):
        body = cp.assert_problem(await cp.create_key(tenant="team-a", priority=bad), 422)
        assert body["errors"][0]["loc"][:2] == ["body", "priority"]


async def test_a_key_for_an_unknown_tenant_is_refused_and_creates_nothing(cp: ControlPlane) -> None:
    assert (await cp.http.post("/v1/tenants", json={"name": "acme", "zone": "eu"}, headers=cp.admin)).status_code == 201
    audit_before = await cp.admin_list("/v1/audit")
    # A typo of a tenant's name: no tenant appears in zone global with a working key.
    r = await cp.http.post("/v1/api-keys", json={"name": "k", "tenant": "acmee", "scopes": ["inference"]},
                           headers=cp.admin)
    body = cp.assert_problem(r, 404)
    assert body["detail"].startswith("no tenant 'acmee' (did you mean 'acme'?)")
    assert "create_tenant" in body["detail"]
    assert [t["name"] for t in await cp.admin_list("/v1/tenants")] == ["acme"]
    assert [k["tenant"] for k in await cp.admin_list("/v1/api-keys")] == ["meridian"]  # the bootstrap key alone
    assert await cp.admin_list("/v1/audit") == audit_before


async def test_create_tenant_creates_it_in_the_zone_given_and_says_so(cp: ControlPlane) -> None:
    r = await cp.http.post("/v1/api-keys", json={"name": "k", "tenant": "newco", "scopes": ["inference"],
                                                 "create_tenant": True}, headers=cp.admin)
    body = cp.assert_problem(r, 422)  # no default residency for a new tenant
    assert "create_tenant needs the new tenant's zone" in str(body["errors"])
    cp.assert_problem(await cp.create_key(tenant="newco", zone="mars"), 400)
    made = await cp.create_key(tenant="newco", zone="us")
    assert made.status_code == 201 and made.json()["tenant_created"] is True and made.json()["zone"] == "us"
    [tenant] = await cp.admin_list("/v1/tenants")
    assert (tenant["name"], tenant["zone"]) == ("newco", "us")
    # Asking again for a tenant that now exists makes a key for it, and no tenant.
    again = await cp.create_key(tenant="newco", zone="us")
    assert again.status_code == 201 and again.json()["tenant_created"] is False
    plain = await cp.http.post("/v1/api-keys", json={"name": "k", "tenant": "newco", "scopes": ["inference"]},
                               headers=cp.admin)
    assert plain.status_code == 201 and plain.json()["tenant_created"] is False
