"""Placement plans through the admin API: preview with a diff, apply, staleness, infeasibility,
and plans only over the providers whose drivers the control plane runs."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from cp_harness import LOOPS_OFF, ControlPlane

from control_plane.context import AppContext
from control_plane.db.models import PlacementPlan
from meridian.settings.providers import ProviderSettings

ONPREM_ONLY = pytest.mark.parametrize("provider_settings", [ProviderSettings(enabled=["onprem"])], ids=["onprem-only"])


@pytest.fixture
def provider_settings() -> ProviderSettings:
    # Every built-in provider's driver enabled (as a multi-cloud control plane runs), so plans
    # may use all three; the reconciler stays off, so no driver is ever called.
    return ProviderSettings(enabled=["aws", "gcp", "onprem"])


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return LOOPS_OFF

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
    first = await _preview(cp)
    r = await cp.http.post(f"/v1/placement/plans/{first['id']}/apply", headers=cp.admin)
    assert r.status_code == 200, r.text
    await _deployment(cp, "chat-8b", "us", replicas={"aws:us-east-1": 3})
    second = await _preview(cp)
    assert second["base_plan_id"] == first["id"]
    # Another operator re-plans and applies meanwhile: the second was solved against a placement
    # no longer in force.
    third = await _preview(cp)
    r = await cp.http.post(f"/v1/placement/plans/{third['id']}/apply", headers=cp.admin)
    assert r.status_code == 200, r.text
    r = await cp.http.post(f"/v1/placement/plans/{second['id']}/apply", headers=cp.admin)
    body = cp.assert_problem(r, 409)
    assert "preview a new plan" in body["detail"]


async def test_only_the_newest_preview_can_be_applied(cp: ControlPlane) -> None:
    await _model(cp, "chat-8b")
    await _deployment(cp, "chat-8b", "us", replicas={"aws:us-east-1": 2})
    older, newer = await _preview(cp), await _preview(cp)
    # The older preview is superseded the moment the newer one is stored, and cannot be applied.
    plans = {p["id"]: p["status"] for p in await cp.admin_list("/v1/placement/plans")}
    assert (plans[older["id"]], plans[newer["id"]]) == ("superseded", "preview")
    body = cp.assert_problem(await cp.http.post(f"/v1/placement/plans/{older['id']}/apply", headers=cp.admin), 409)
    assert f"plan {older['id']} is a stale preview" in body["detail"]
    r = await cp.http.get("/v1/placement/current", headers=cp.admin)
    cp.assert_problem(r, 404)  # nothing was put in force

    # Applying the newest supersedes any preview left: none can be applied over it.
    r = await cp.http.post(f"/v1/placement/plans/{newer['id']}/apply", headers=cp.admin)
    assert r.status_code == 200, r.text
    body = cp.assert_problem(await cp.http.post(f"/v1/placement/plans/{older['id']}/apply", headers=cp.admin), 409)
    assert "stale preview" in body["detail"]
    assert (await cp.http.get("/v1/placement/current", headers=cp.admin)).json()["id"] == newer["id"]


@ONPREM_ONLY
async def test_a_plan_over_disabled_drivers_is_never_proposed_nor_applied(cp: ControlPlane) -> None:
    # On-prem's driver alone: the eu zone's aws and gcp regions are no candidates.
    await _model(cp, "chat-8b")
    await _deployment(cp, "chat-8b", "eu", min_regions=1)
    plan = await _preview(cp)
    assert plan["status"] == "preview", plan["explanation"]
    assert {a["region"] for a in plan["assignments"]} == {"onprem:fra-dc1"}
    r = await cp.http.post(f"/v1/placement/plans/{plan['id']}/apply", headers=cp.admin)
    assert r.status_code == 200, r.text

    # The us zone has no on-prem site: infeasible, and the explanation says which drivers are off.
    await _model(cp, "us-8b")
    await _deployment(cp, "us-8b", "us")
    plan = await _preview(cp)
    assert plan["status"] == "infeasible" and plan["assignments"] == []
    assert "deployment us-8b: no region of zone 'us'" in plan["explanation"]
    assert "not planned on aws, gcp: MERIDIAN_PROVIDER_ENABLED does not enable their drivers" in plan["explanation"]


@ONPREM_ONLY
async def test_a_preview_on_a_provider_without_a_driver_is_refused(cp: ControlPlane) -> None:
    # Previewed while aws was enabled, applied after it was turned off.
    plan_id = str(uuid.uuid4())
    ctx: AppContext = cp.app.state.ctx
    with ctx.write() as session:
        session.add(PlacementPlan(
            id=plan_id, status="preview", base_plan_id=None, cost_per_hour=1.0, diff={}, explanation=None,
            assignments=[{"deployment": "chat-8b", "region": "aws:us-east-1", "instance_type": "g5.xlarge",
                          "sku": "A10G-24GB", "instances": 1, "replicas": 1}],
            solve_seconds=0.1, created_at=datetime.now(UTC), created_by="test",
        ))
    body = cp.assert_problem(await cp.http.post(f"/v1/placement/plans/{plan_id}/apply", headers=cp.admin), 409)
    assert "places node groups on aws, which this control plane has no driver for" in body["detail"]
    assert "MERIDIAN_PROVIDER_ENABLED: onprem" in body["detail"]
    cp.assert_problem(await cp.http.get("/v1/placement/current", headers=cp.admin), 404)


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
