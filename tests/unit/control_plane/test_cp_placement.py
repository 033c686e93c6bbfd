"""Placement plans through the admin API: preview with a diff, apply, staleness, infeasibility."""

from __future__ import annotations

from typing import Any

from cp_harness import ControlPlane

LLAMA_8B = {
    "params_b": 8.03, "layers": 32, "kv_heads": 8, "head_dim": 128, "attention_heads": 32,
    "hidden_size": 4096, "quantization": "bf16", "kv_cache_dtype": "bf16",
    "max_context": 8192, "target_concurrent_seqs": 16,
}


async def _model(cp: ControlPlane, name: str, **spec: Any) -> None:
    r = await cp.http.put(f"/v1/models/{name}", json={**LLAMA_8B, **spec}, headers=cp.admin)
    assert r.status_code in (200, 201), r.text


async def _deployment(cp: ControlPlane, model: str, zone: str, **placement: Any) -> None:
    body = {"zone": zone, "min_replicas": 1, "max_replicas": 8, "placement": placement}
    r = await cp.http.put(f"/v1/deployments/{model}", json=body, headers=cp.admin)
    assert r.status_code in (200, 201), r.text


async def _preview(cp: ControlPlane) -> dict[str, Any]:
    r = await cp.http.post("/v1/placement/plans", json={"time_limit_s": 10}, headers=cp.admin)
    assert r.status_code == 201, r.text
    plan: dict[str, Any] = r.json()
    return plan


async def test_preview_apply_and_replan_without_churn(cp: ControlPlane) -> None:
    await _model(cp, "chat-8b")
    await _deployment(cp, "chat-8b", "eu", demand={"gcp:europe-west4": 1500.0}, rtt_objective_ms=40)
    eu_regions = {r["name"] for r in (await cp.http.get("/v1/regions", headers=cp.admin)).json() if "eu" in r["zones"]}

    plan = await _preview(cp)
    assert plan["status"] == "preview", plan["explanation"]
    assert plan["base_plan_id"] is None
    regions = {a["region"] for a in plan["assignments"]}
    assert regions <= eu_regions  # residency
    assert len(regions) >= 2  # active-active spread
    assert len({r.split(":")[0] for r in regions}) >= 2  # two providers: the eu zone has aws and gcp
    assert plan["diff"]["added"] and not plan["diff"]["removed"]
    assert plan["cost_per_hour"] > 0

    r = await cp.http.get("/v1/placement/current", headers=cp.admin)
    cp.assert_problem(r, 404)
    r = await cp.http.post(f"/v1/placement/plans/{plan['id']}/apply", headers=cp.admin)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "applied"
    current = (await cp.http.get("/v1/placement/current", headers=cp.admin)).json()
    assert current["id"] == plan["id"]

    # Nothing changed: a new plan keeps every replica where it is.
    again = await _preview(cp)
    assert again["base_plan_id"] == plan["id"]
    assert again["diff"]["added"] == again["diff"]["removed"] == again["diff"]["changed"] == []

    # Applying an already applied plan is refused.
    r = await cp.http.post(f"/v1/placement/plans/{plan['id']}/apply", headers=cp.admin)
    cp.assert_problem(r, 409)

    audit = (await cp.http.get("/v1/audit", params={"resource_type": "placement_plan"}, headers=cp.admin)).json()
    assert {(e["action"], e["resource_id"]) for e in audit} >= {("preview", plan["id"]), ("apply", plan["id"])}


async def test_a_plan_solved_against_a_replaced_placement_cannot_be_applied(cp: ControlPlane) -> None:
    await _model(cp, "chat-8b")
    await _deployment(cp, "chat-8b", "us", replicas={"aws:us-east-1": 2})
    first, second = await _preview(cp), await _preview(cp)
    r = await cp.http.post(f"/v1/placement/plans/{second['id']}/apply", headers=cp.admin)
    assert r.status_code == 200, r.text
    r = await cp.http.post(f"/v1/placement/plans/{first['id']}/apply", headers=cp.admin)
    body = cp.assert_problem(r, 409)
    assert "preview a new plan" in body["detail"]


async def test_infeasible_input_names_the_constraint(cp: ControlPlane) -> None:
    await _deployment(cp, "no-spec", "eu")
    plan = await _preview(cp)
    assert plan["status"] == "infeasible"
    assert "no-spec" in plan["explanation"] and "model spec" in plan["explanation"]

    await _model(cp, "no-spec")
    # No region of the eu zone is within 5 ms of Tokyo.
    await _deployment(cp, "no-spec", "eu", demand={"onprem:tokyo-1": 100.0}, rtt_objective_ms=5)
    plan = await _preview(cp)
    assert plan["status"] == "infeasible"
    assert "zone 'eu'" in plan["explanation"] and "within 5 ms" in plan["explanation"]
    r = await cp.http.post(f"/v1/placement/plans/{plan['id']}/apply", headers=cp.admin)
    cp.assert_problem(r, 409)


async def test_read_only_keys_see_plans_but_cannot_make_them(cp: ControlPlane) -> None:
    r = await cp.create_key(name="ro", tenant="ops", zone="global", scopes=["read-only"])
    ro = {"authorization": f"Bearer {r.json()['key']}"}
    cp.assert_problem(await cp.http.post("/v1/placement/plans", headers=ro), 403)
    assert (await cp.http.get("/v1/placement/plans", headers=ro)).status_code == 200


async def test_a_disaggregated_deployment_is_planned_as_prefill_and_decode_nodes_per_region(cp: ControlPlane) -> None:
    await _model(cp, "rag-8b")
    body = {"zone": "eu", "min_replicas": 1, "max_replicas": 8,
            "placement": {"demand": {"gcp:europe-west4": 1500.0}, "rtt_objective_ms": 40},
            "disaggregation": {"mean_prompt_tokens": 8000, "mean_output_tokens": 200}}
    r = await cp.http.put("/v1/deployments/rag-8b", json=body, headers=cp.admin)
    assert r.status_code == 201, r.text
    plan = await _preview(cp)
    assert plan["status"] == "preview", plan["explanation"]
    eu = {r["name"] for r in (await cp.http.get("/v1/regions", headers=cp.admin)).json() if "eu" in r["zones"]}
    by_region: dict[str, dict[str, int]] = {}
    for a in plan["assignments"]:
        by_region.setdefault(a["region"], {}).setdefault(a["role"], 0)
        by_region[a["region"]][a["role"]] += a["instances"]
    assert set(by_region) <= eu and len(by_region) >= 2
    # Both pools in every region; a prompt-heavy mix (40 prompt tokens per generated one) wants
    # as many prefill nodes as decode nodes at least.
    for pools in by_region.values():
        assert set(pools) == {"prefill", "decode"}
        assert pools["prefill"] >= pools["decode"] >= 1
