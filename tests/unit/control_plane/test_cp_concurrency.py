"""Optimistic concurrency: If-Match / If-None-Match preconditions (412), conflicting creations (409).

Sync endpoints run in the app's threadpool, so requests gathered here really race.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest
from admin_harness import MODEL_SPEC
from cp_harness import ControlPlane

# Resources updated by PUT of a whole body: (url, body at version 1, body of an update).
PUT_RESOURCES = (
    ("/v1/models/org/m", MODEL_SPEC, {**MODEL_SPEC, "max_context": 4096}),
    ("/v1/deployments/org/m", {"max_replicas": 2}, {"max_replicas": 3}),
    ("/v1/capacity/aws:us-east-1/L4-24GB", {"max_gpus": 8}, {"max_gpus": 16}),
)


async def _put(cp: ControlPlane, url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return await cp.http.put(url, json=body, headers={**cp.admin, **headers})


@pytest.mark.parametrize(("url", "v1", "update"), PUT_RESOURCES, ids=["model", "deployment", "capacity"])
async def test_stale_if_match_is_412_and_changes_nothing(
    cp: ControlPlane, url: str, v1: dict[str, Any], update: dict[str, Any]
) -> None:
    cp.assert_problem(await _put(cp, url, v1, **{"if-match": '"1"'}), 412)  # nothing to match yet
    assert (await _put(cp, url, v1)).status_code == 201
    r = await _put(cp, url, update, **{"if-match": '"1"'})
    assert r.status_code == 200 and r.headers["etag"] == '"2"'
    before = (await cp.http.get(url, headers=cp.admin)).json()

    body = cp.assert_problem(await _put(cp, url, v1, **{"if-match": '"1"'}), 412)
    assert "version 2" in body["detail"]
    cp.assert_problem(await cp.http.delete(url, headers={**cp.admin, "if-match": 'W/"1"'}), 412)
    # If-Match compares strongly (RFC 9110): even the current version's weak tag matches nothing.
    cp.assert_problem(await _put(cp, url, v1, **{"if-match": 'W/"2"'}), 412)
    cp.assert_problem(await cp.http.delete(url, headers={**cp.admin, "if-match": 'W/"2"'}), 412)
    assert (await cp.http.get(url, headers=cp.admin)).json() == before

    # If-None-Match: * creates only.
    cp.assert_problem(await _put(cp, url, v1, **{"if-none-match": "*"}), 412)
    assert (await cp.http.get(url, headers=cp.admin)).json() == before

    # Any of several tags, or *, matches.
    assert (await _put(cp, url, v1, **{"if-match": '"7", "2"'})).status_code == 200
    assert (await cp.http.delete(url, headers={**cp.admin, "if-match": "*"})).status_code == 204


async def test_stale_if_match_on_a_tenant_is_412_and_changes_nothing(cp: ControlPlane) -> None:
    assert (await cp.http.post("/v1/tenants", json={"name": "acme"}, headers=cp.admin)).status_code == 201
    r = await cp.http.patch("/v1/tenants/acme", json={"zone": "eu"}, headers={**cp.admin, "if-match": '"1"'})
    assert r.status_code == 200
    before = r.json()
    r = await cp.http.patch("/v1/tenants/acme", json={"zone": "us"}, headers={**cp.admin, "if-match": '"1"'})
    cp.assert_problem(r, 412)
    cp.assert_problem(await cp.http.delete("/v1/tenants/acme", headers={**cp.admin, "if-match": '"1"'}), 412)
    assert (await cp.http.get("/v1/tenants/acme", headers=cp.admin)).json() == before


async def test_creating_an_existing_tenant_is_409(cp: ControlPlane) -> None:
    assert (await cp.http.post("/v1/tenants", json={"name": "acme"}, headers=cp.admin)).status_code == 201
    body = cp.assert_problem(await cp.http.post("/v1/tenants", json={"name": "acme", "zone": "eu"},
                                                headers=cp.admin), 409)
    assert "acme" in body["detail"]
    assert (await cp.http.get("/v1/tenants/acme", headers=cp.admin)).json()["zone"] == "global"


@pytest.mark.parametrize(("url", "v1", "update"), PUT_RESOURCES, ids=["model", "deployment", "capacity"])
async def test_concurrent_updates_with_one_etag_one_wins(
    cp: ControlPlane, url: str, v1: dict[str, Any], update: dict[str, Any]
) -> None:
    assert (await _put(cp, url, v1)).status_code == 201
    bodies = (update, v1)
    for round_ in range(6):
        etag = (await cp.http.get(url, headers=cp.admin)).headers["etag"]
        answers = await asyncio.gather(
            *(_put(cp, url, bodies[round_ % 2], **{"if-match": etag}) for _ in range(4))
        )
        assert Counter(a.status_code for a in answers) == {200: 1, 412: 3}, [a.text for a in answers]
        winner = next(a for a in answers if a.status_code == 200)
        assert winner.headers["etag"] != etag
        assert (await cp.http.get(url, headers=cp.admin)).headers["etag"] == winner.headers["etag"]


async def test_concurrent_tenant_patches_with_one_etag_one_wins(cp: ControlPlane) -> None:
    assert (await cp.http.post("/v1/tenants", json={"name": "acme"}, headers=cp.admin)).status_code == 201
    for round_ in range(6):
        etag = (await cp.http.get("/v1/tenants/acme", headers=cp.admin)).headers["etag"]
        answers = await asyncio.gather(*(
            cp.http.patch("/v1/tenants/acme", json={"requests_per_minute": 100 * round_ + i + 1},
                          headers={**cp.admin, "if-match": etag})
            for i in range(4)
        ))
        assert Counter(a.status_code for a in answers) == {200: 1, 412: 3}, [a.text for a in answers]


async def test_concurrent_creations_make_one(cp: ControlPlane) -> None:
    answers = await asyncio.gather(
        *(_put(cp, "/v1/models/m", MODEL_SPEC, **{"if-none-match": "*"}) for _ in range(4)),
    )
    codes = Counter(a.status_code for a in answers)
    # Postgres may let two creators past the existence check; the loser's insert is then a 409.
    assert codes[201] == 1 and set(codes) <= {201, 409, 412}, [a.text for a in answers]
    tenants = await asyncio.gather(
        *(cp.http.post("/v1/tenants", json={"name": "acme"}, headers=cp.admin) for _ in range(4))
    )
    codes = Counter(t.status_code for t in tenants)
    assert codes == {201: 1, 409: 3}, [t.text for t in tenants]
