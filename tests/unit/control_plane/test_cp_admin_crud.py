"""Admin API round trips (tenants, models, deployments, capacity, the catalog) and pagination."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from admin_harness import MODEL_SPEC, walk
from cp_harness import ControlPlane

from control_plane.placement.fit import BYTES_PER_WEIGHT, KV_BYTES
from meridian.admin_api import KvCacheDtype, Quantization


def test_model_dtypes_are_the_ones_fit_knows() -> None:
    assert set(get_args(Quantization)) == set(BYTES_PER_WEIGHT)
    assert set(get_args(KvCacheDtype)) == set(KV_BYTES)


async def test_tenant_round_trip(cp: ControlPlane) -> None:
    r = await cp.http.post("/v1/tenants", json={"name": "acme", "zone": "eu", "requests_per_minute": 60},
                           headers=cp.admin)
    assert r.status_code == 201, r.text
    assert r.headers["etag"] == '"1"'
    created = r.json()
    assert (created["zone"], created["requests_per_minute"], created["models"]) == ("eu", 60, None)

    got = await cp.http.get("/v1/tenants/acme", headers=cp.admin)
    assert got.json() == created and got.headers["etag"] == '"1"'

    r = await cp.http.patch("/v1/tenants/acme", json={"models": ["m"], "requests_per_minute": None},
                            headers={**cp.admin, "if-match": '"1"'})
    assert r.status_code == 200, r.text
    assert (r.json()["models"], r.json()["requests_per_minute"], r.json()["resource_version"]) == (["m"], None, 2)
    assert r.headers["etag"] == '"2"'

    assert [t["name"] for t in (await cp.http.get("/v1/tenants", headers=cp.admin)).json()] == ["acme"]
    r = await cp.http.delete("/v1/tenants/acme", headers={**cp.admin, "if-match": '"2"'})
    assert r.status_code == 204
    cp.assert_problem(await cp.http.get("/v1/tenants/acme", headers=cp.admin), 404)
    cp.assert_problem(await cp.http.delete("/v1/tenants/acme", headers=cp.admin), 404)


async def test_tenant_priority_and_weight_round_trip(cp: ControlPlane) -> None:
    """Flow control's band and weight (issue 37): defaults, set, changed, and refused out of range."""
    r = await cp.http.post("/v1/tenants", json={"name": "plain", "zone": "eu"}, headers=cp.admin)
    assert r.status_code == 201, r.text
    assert (r.json()["priority"], r.json()["weight"]) == (0, 1.0)

    r = await cp.http.post("/v1/tenants", json={"name": "acme", "zone": "eu", "priority": 5, "weight": 2.5},
                           headers=cp.admin)
    assert r.status_code == 201, r.text
    created = r.json()
    assert (created["priority"], created["weight"]) == (5, 2.5)
    assert (await cp.http.get("/v1/tenants/acme", headers=cp.admin)).json() == created

    r = await cp.http.patch("/v1/tenants/acme", json={"priority": -10, "weight": 1000},
                            headers={**cp.admin, "if-match": '"1"'})
    assert r.status_code == 200, r.text
    assert (r.json()["priority"], r.json()["weight"], r.json()["resource_version"]) == (-10, 1000.0, 2)
    # Leaving them out leaves them be.
    r = await cp.http.patch("/v1/tenants/acme", json={"requests_per_minute": 60}, headers=cp.admin)
    assert (r.json()["priority"], r.json()["weight"]) == (-10, 1000.0)

    json_headers = {**cp.admin, "content-type": "application/json"}
    for bad in ({"priority": 11}, {"priority": -11}, {"priority": 1.5}, {"weight": 0}, {"weight": -1},
                {"weight": 1000.5}):
        body = cp.assert_problem(await cp.http.post("/v1/tenants", json={"name": "b", **bad}, headers=cp.admin), 422)
        assert body["errors"][0]["loc"][:2] == ["body", next(iter(bad))]
        cp.assert_problem(await cp.http.patch("/v1/tenants/acme", json=bad, headers=cp.admin), 422)
    # Python's JSON reader takes these; a weight divides work, so they are refused as the others.
    for word in (b"Infinity", b"NaN"):
        cp.assert_problem(await cp.http.post("/v1/tenants", content=b'{"name": "b", "weight": ' + word + b"}",
                                             headers=json_headers), 422)
    # Not a limit to clear: every tenant has a band and a weight.
    for field in ("priority", "weight"):
        body = cp.assert_problem(await cp.http.patch("/v1/tenants/acme", json={field: None}, headers=cp.admin), 400)
        assert field in body["detail"]
    r = await cp.http.get("/v1/tenants/acme", headers=cp.admin)
    assert (r.json()["priority"], r.json()["weight"], r.json()["resource_version"]) == (-10, 1000.0, 3)
    cp.assert_problem(await cp.http.get("/v1/tenants/b", headers=cp.admin), 404)


async def test_model_round_trip(cp: ControlPlane) -> None:
    url = "/v1/models/meta-llama/Llama-3.1-8B"
    r = await cp.http.put(url, json=MODEL_SPEC, headers=cp.admin)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["name"] == "meta-llama/Llama-3.1-8B"
    assert (created["quantization"], created["kv_cache_dtype"], created["resource_version"]) == ("bf16", "bf16", 1)
    assert r.headers["etag"] == '"1"'

    got = await cp.http.get(url, headers=cp.admin)
    assert got.status_code == 200 and got.json() == created and got.headers["etag"] == '"1"'

    # The same spec again is no change: same version.
    r = await cp.http.put(url, json=MODEL_SPEC, headers=cp.admin)
    assert r.status_code == 200 and r.json()["resource_version"] == 1

    r = await cp.http.put(url, json={**MODEL_SPEC, "quantization": "fp8"}, headers={**cp.admin, "if-match": '"1"'})
    assert r.status_code == 200 and r.json()["quantization"] == "fp8" and r.json()["resource_version"] == 2

    listed = (await cp.http.get("/v1/models", headers=cp.admin)).json()
    assert [m["name"] for m in listed] == ["meta-llama/Llama-3.1-8B"]

    # A deployment of the model holds it in place.
    assert (await cp.http.put("/v1/deployments/meta-llama/Llama-3.1-8B", json={}, headers=cp.admin)).status_code == 201
    body = cp.assert_problem(await cp.http.delete(url, headers=cp.admin), 409)
    assert "deployment" in body["detail"]
    assert (await cp.http.delete("/v1/deployments/meta-llama/Llama-3.1-8B", headers=cp.admin)).status_code == 204

    assert (await cp.http.delete(url, headers={**cp.admin, "if-match": '"2"'})).status_code == 204
    cp.assert_problem(await cp.http.get(url, headers=cp.admin), 404)
    cp.assert_problem(await cp.http.get(f"{url}/fit", headers=cp.admin), 404)


async def test_model_fit_per_sku(cp: ControlPlane) -> None:
    await cp.http.put("/v1/models/llama-3-70b", headers=cp.admin, json={
        "params_b": 70.6, "layers": 80, "kv_heads": 8, "head_dim": 128, "attention_heads": 64, "hidden_size": 8192,
    })
    r = await cp.http.get("/v1/models/llama-3-70b/fit", headers=cp.admin)
    assert r.status_code == 200, r.text
    fit = r.json()
    by_sku = {f["sku"]: f for f in fit["fits"]}
    # 141 GB of bf16 weights: two H100s at least, never one; an 8 GB P4 holds no replica even with TP 8.
    assert by_sku["H100-80GB-SXM"]["tensor_parallel"] >= 2
    assert "P4-8GB" in fit["does_not_fit"] and "P4-8GB" not in by_sku
    assert set(by_sku) | set(fit["does_not_fit"]) == {s["name"] for s in (await cp.http.get(
        "/v1/skus", headers=cp.admin)).json()}
    for f in fit["fits"]:
        assert f["used_gib_per_gpu"] <= f["usable_gib_per_gpu"]
        assert f["decode_tokens_per_s"] > 0 and f["prefill_tokens_per_s"] > 0
    h100 = by_sku["H100-80GB-SXM"]
    assert h100["weights_gib_per_gpu"] == pytest.approx(70.6e9 * 2 / h100["tensor_parallel"] / 1024**3)
    cheapest = h100["cheapest"]
    assert cheapest is not None and cheapest["usd_per_million_tokens"] > 0 and not cheapest["spot"]
    # Cheapest per token first; SKUs that no provider prices come last.
    costs = [f["cheapest"]["usd_per_million_tokens"] for f in fit["fits"] if f["cheapest"]]
    assert costs == sorted(costs)
    spot = (await cp.http.get("/v1/models/llama-3-70b/fit", params={"spot": "true"}, headers=cp.admin)).json()
    assert all(f["cheapest"] is None or f["cheapest"]["spot"] for f in spot["fits"])


async def test_invalid_models_are_refused(cp: ControlPlane) -> None:
    async def put(**changes: Any) -> dict[str, Any]:
        return cp.assert_problem(await cp.http.put("/v1/models/m", json={**MODEL_SPEC, **changes}, headers=cp.admin),
                                 422)

    await put(layers=0)
    await put(params_b=-1)
    await put(params_b=20_000)
    await put(max_context=20_000_000)
    await put(quantization="fp4")
    await put(kv_cache_dtype="int4")
    await put(attention_heads=30)  # not a multiple of kv_heads
    await put(weights_uri="ftp://example.com/m")
    await put(colour="blue")
    body = MODEL_SPEC.copy()
    del body["layers"]
    cp.assert_problem(await cp.http.put("/v1/models/m", json=body, headers=cp.admin), 422)
    assert (await cp.http.get("/v1/models", headers=cp.admin)).json() == []


async def test_deployment_round_trip_with_etags(cp: ControlPlane) -> None:
    r = await cp.http.put("/v1/deployments/m", json={"zone": "eu", "max_replicas": 2},
                          headers={**cp.admin, "if-none-match": "*"})
    assert r.status_code == 201 and r.headers["etag"] == '"1"'
    r = await cp.http.put("/v1/deployments/m", json={"zone": "eu", "max_replicas": 3},
                          headers={**cp.admin, "if-match": '"1"'})
    assert r.status_code == 200 and r.json()["max_replicas"] == 3 and r.headers["etag"] == '"2"'
    got = await cp.http.get("/v1/deployments/m", headers=cp.admin)
    assert got.json() == r.json() and got.headers["etag"] == '"2"'
    assert (await cp.http.delete("/v1/deployments/m", headers={**cp.admin, "if-match": '"2"'})).status_code == 204
    cp.assert_problem(await cp.http.get("/v1/deployments/m", headers=cp.admin), 404)


async def test_capacity_round_trip_over_inventory_defaults(cp: ControlPlane) -> None:
    listed = (await cp.http.get("/v1/capacity", headers=cp.admin)).json()
    by_key = {(c["region"], c["sku"]): c for c in listed}
    # The default inventory racks 4 DGX H100 (8 GPUs each) in Tokyo.
    tokyo = by_key[("onprem:tokyo-1", "H100-80GB-SXM")]
    assert (tokyo["max_gpus"], tokyo["source"], tokyo["resource_version"]) == (32, "inventory", None)
    assert all(c["region"].startswith("onprem:") for c in listed)

    url = "/v1/capacity/onprem:tokyo-1/H100-80GB-SXM"
    r = await cp.http.put(url, json={"max_gpus": 16}, headers=cp.admin)
    assert r.status_code == 201, r.text
    assert (r.json()["max_gpus"], r.json()["source"], r.headers["etag"]) == (16, "explicit", '"1"')
    r = await cp.http.put("/v1/capacity/aws:us-east-1/H100-80GB-SXM", json={"max_gpus": 64}, headers=cp.admin)
    assert r.status_code == 201

    got = await cp.http.get(url, headers=cp.admin)
    assert got.json()["max_gpus"] == 16 and got.headers["etag"] == '"1"'
    listed = (await cp.http.get("/v1/capacity", params={"sku": "H100-80GB-SXM"}, headers=cp.admin)).json()
    assert [(c["region"], c["max_gpus"], c["source"]) for c in listed] == [
        ("aws:us-east-1", 64, "explicit"),
        ("onprem:tokyo-1", 16, "explicit"),
    ]

    r = await cp.http.put(url, json={"max_gpus": 8}, headers={**cp.admin, "if-match": '"1"'})
    assert r.status_code == 200 and r.headers["etag"] == '"2"'
    assert (await cp.http.delete(url, headers={**cp.admin, "if-match": '"2"'})).status_code == 204
    # Back to what the inventory racks.
    got = (await cp.http.get(url, headers=cp.admin)).json()
    assert (got["max_gpus"], got["source"]) == (32, "inventory")
    cp.assert_problem(await cp.http.delete(url, headers=cp.admin), 404)
    cp.assert_problem(await cp.http.get("/v1/capacity/gcp:us-central1/B200", headers=cp.admin), 404)


async def test_capacity_needs_a_known_region_and_a_canonical_sku(cp: ControlPlane) -> None:
    body = cp.assert_problem(
        await cp.http.put("/v1/capacity/aws:nowhere-1/H100-80GB-SXM", json={"max_gpus": 1}, headers=cp.admin), 400)
    assert "aws:nowhere-1" in body["detail"]
    body = cp.assert_problem(
        await cp.http.put("/v1/capacity/aws:us-east-1/A100-80gb", json={"max_gpus": 1}, headers=cp.admin), 400)
    assert "A100-80GB" in body["detail"]  # the canonical spelling, as a hint
    cp.assert_problem(
        await cp.http.put("/v1/capacity/aws:us-east-1/L4-24GB", json={"max_gpus": -1}, headers=cp.admin), 422)
    cp.assert_problem(
        await cp.http.put("/v1/capacity/aws:us-east-1/L4-24GB", json={"max_gpus": 1, "x": 1}, headers=cp.admin), 422)


async def test_catalog_views(cp: ControlPlane) -> None:
    providers = (await cp.http.get("/v1/providers", headers=cp.admin)).json()
    assert [p["name"] for p in providers] == ["aws", "gcp", "onprem"]
    onprem = (await cp.http.get("/v1/providers/onprem", headers=cp.admin)).json()
    assert onprem == providers[2]
    assert "onprem:tokyo-1" in onprem["regions"] and "H100-80GB-SXM" in onprem["skus"]
    cp.assert_problem(await cp.http.get("/v1/providers/azure", headers=cp.admin), 404)

    offerings = (await cp.http.get("/v1/providers/onprem/offerings", params={"region": "onprem:tokyo-1"},
                                   headers=cp.admin)).json()
    assert {(o["instance_type"], o["sku"], o["max_instances"]) for o in offerings} >= {
        ("dgx-h100", "H100-80GB-SXM", 4)
    }
    # Any spelling of a GPU filters by its canonical SKU.
    p5 = (await cp.http.get("/v1/providers/aws/offerings", params={"sku": "h100 sxm"}, headers=cp.admin)).json()
    assert p5 and {o["sku"] for o in p5} == {"H100-80GB-SXM"} and {o["max_instances"] for o in p5} == {None}
    cp.assert_problem(
        await cp.http.get("/v1/providers/aws/offerings", params={"sku": "voodoo5"}, headers=cp.admin), 400)

    sku = (await cp.http.get("/v1/skus/a100 80gb", headers=cp.admin)).json()
    assert sku["name"] == "A100-80GB" and sku["memory_gib"] == 80.0 and "onprem" in sku["providers"]
    cp.assert_problem(await cp.http.get("/v1/skus/voodoo5", headers=cp.admin), 404)

    zones = {z["name"]: z for z in (await cp.http.get("/v1/zones", headers=cp.admin)).json()}
    assert "global" not in zones
    assert "onprem:fra-dc1" in zones["eu"]["regions"] and set(zones["eu"]["providers"]) == {"aws", "gcp", "onprem"}
    assert (await cp.http.get("/v1/zones/eu", headers=cp.admin)).json() == zones["eu"]
    cp.assert_problem(await cp.http.get("/v1/zones/atlantis", headers=cp.admin), 404)

    region = (await cp.http.get("/v1/regions/gcp:europe-west4", headers=cp.admin)).json()
    assert region["provider"] == "gcp" and "eu" in region["zones"]
    cp.assert_problem(await cp.http.get("/v1/regions/gcp:mars-1", headers=cp.admin), 404)


async def test_nodes_one_and_all(cp: ControlPlane) -> None:
    assert (await cp.register("node-a", region="aws:us-east-1")).status_code == 200
    node = (await cp.http.get("/v1/nodes/node-a", headers=cp.admin)).json()
    assert (node["node_id"], node["region"], node["status"]) == ("node-a", "aws:us-east-1", "starting")
    assert (await cp.http.get("/v1/nodes", headers=cp.admin)).json() == [node]
    cp.assert_problem(await cp.http.get("/v1/nodes/node-b", headers=cp.admin), 404)


def _seen(pages: list[list[Any]], key: str) -> list[Any]:
    return [row[key] for page in pages for row in page]


async def test_pagination_walks_every_row_once(cp: ControlPlane) -> None:
    names = [f"r{i}" for i in range(7)]
    for name in reversed(names):
        assert (await cp.http.post("/v1/tenants", json={"name": name}, headers=cp.admin)).status_code == 201
        assert (await cp.http.put(f"/v1/models/org/{name}", json=MODEL_SPEC, headers=cp.admin)).status_code == 201
        assert (await cp.http.put(f"/v1/deployments/{name}", json={}, headers=cp.admin)).status_code == 201
        assert (await cp.register(f"node-{name}", region="gcp:europe-west4")).status_code == 200
        r = await cp.http.put(f"/v1/capacity/aws:us-east-1/{'L4-24GB' if name < 'r4' else 'L40S-48GB'}",
                              json={"max_gpus": int(name[1:])}, headers=cp.admin)
        assert r.status_code in (200, 201)

    async def pages(url: str, key: str, **params: Any) -> list[Any]:
        walked = await walk(cp, url, cp.admin, limit=3, **params)
        assert [len(p) for p in walked][:-1] == [3] * (len(walked) - 1)
        return _seen(walked, key)

    assert await pages("/v1/tenants", "name") == names
    assert await pages("/v1/models", "name") == [f"org/{n}" for n in names]
    assert await pages("/v1/deployments", "model") == names
    assert await pages("/v1/nodes", "node_id") == [f"node-{n}" for n in names]
    ids = await pages("/v1/audit", "id")
    assert ids == sorted(ids, reverse=True) and len(ids) == len(set(ids)) >= 7 * 4

    # Filters stay on every page (the Link keeps the request's other parameters).
    # Newest first: the tenants were created from r6 down to r0.
    assert await pages("/v1/audit", "resource_id", resource_type="tenant") == names

    # In-memory listings page the same way.
    regions = await pages("/v1/regions", "name")
    assert regions == sorted(regions) and len(regions) == len(set(regions)) > 7
    offerings = await walk(cp, "/v1/providers/onprem/offerings", cp.admin, limit=3)
    flat = [(o["region"], o["instance_type"]) for page in offerings for o in page]
    assert flat == sorted(flat) and len(flat) == len(set(flat)) > 3
    capacity = await pages("/v1/capacity", "sku", region="aws:us-east-1")
    assert capacity == ["L4-24GB", "L40S-48GB"]
    skus = await pages("/v1/skus", "name")
    assert skus == sorted(set(skus)) and len(skus) > 7
    assert await pages("/v1/providers", "name") == ["aws", "gcp", "onprem"]
    zones = await pages("/v1/zones", "name")
    assert zones == sorted(set(zones))


async def test_listing_errors_are_problems(cp: ControlPlane) -> None:
    for url in ("/v1/tenants", "/v1/models", "/v1/audit", "/v1/regions", "/v1/capacity", "/v1/skus", "/v1/nodes"):
        cp.assert_problem(await cp.http.get(url, params={"limit": 0}, headers=cp.admin), 422)
        cp.assert_problem(await cp.http.get(url, params={"limit": 100_000}, headers=cp.admin), 422)
        cp.assert_problem(await cp.http.get(url, params={"cursor": "garbage"}, headers=cp.admin), 400)
    # A cursor of another listing is refused, not misread.
    first = await cp.http.get("/v1/regions", params={"limit": 1}, headers=cp.admin)
    cursor = first.headers["link"].split("cursor=")[1].split(">")[0]
    cp.assert_problem(await cp.http.get("/v1/audit", params={"cursor": cursor}, headers=cp.admin), 400)
    cp.assert_problem(await cp.http.get("/v1/providers/aws/offerings", params={"cursor": cursor},
                                        headers=cp.admin), 400)


async def test_values_a_database_cannot_store_are_refused(cp: ControlPlane) -> None:
    # Postgres refuses NUL bytes in text and strings longer than their column; SQLite stores both.
    # Validation refuses them on both; where a value still reaches the database, the answer is a 400.
    cp.assert_problem(await cp.http.put("/v1/deployments/a%00b", json={}, headers=cp.admin), 422)
    cp.assert_problem(await cp.http.put("/v1/models/a%00b", json=MODEL_SPEC, headers=cp.admin), 422)
    cp.assert_problem(await cp.http.get("/v1/audit", params={"resource_id": "a\x00b"}, headers=cp.admin), 422)
    r = await cp.http.post("/v1/tenants", json={"name": "acme", "models": ["a\x00b"]}, headers=cp.admin)
    cp.assert_problem(r, 422)
    cp.assert_problem(await cp.create_key(name="a\x00b"), 422)
    r = await cp.register("node-a", url="http://" + "a" * 3000 + ":1")
    assert r.status_code in (200, 400), r.text


async def test_malformed_requests_are_problems(cp: ControlPlane) -> None:
    cp.assert_problem(await cp.http.get("/v1/no-such-thing", headers=cp.admin), 404)
    cp.assert_problem(await cp.http.post("/v1/models", json={}, headers=cp.admin), 405)
    cp.assert_problem(await cp.http.patch("/v1/capacity/aws:us-east-1/L4-24GB", json={}, headers=cp.admin), 405)
    json_headers = {**cp.admin, "content-type": "application/json"}
    cp.assert_problem(await cp.http.put("/v1/models/m", content=b'{"layers": ', headers=json_headers), 422)
    cp.assert_problem(await cp.http.put("/v1/models/m", content=b"[1, 2]", headers=json_headers), 422)
    body = cp.assert_problem(await cp.http.put("/v1/models/m", content=b"layers=1",
                                               headers={**cp.admin, "content-type": "text/plain"}), 415)
    assert "application/json" in body["detail"]
    cp.assert_problem(await cp.http.post("/v1/tenants", content=b'{"name": "x"}',
                                         headers={**cp.admin, "content-type": "application/xml"}), 415)
    # No body at all is a missing field, not a media type problem.
    cp.assert_problem(await cp.http.put("/v1/capacity/aws:us-east-1/L4-24GB", headers=cp.admin), 422)
    huge = {**MODEL_SPEC, "weights_uri": "s3://bucket/" + "x" * (cp.settings.max_request_bytes + 1)}
    cp.assert_problem(await cp.http.put("/v1/models/m", json=huge, headers=cp.admin), 413)
    cp.assert_problem(await cp.http.get("/v1/audit", params={"limit": "ten"}, headers=cp.admin), 422)
    assert (await cp.http.get("/v1/models", headers=cp.admin)).json() == []
