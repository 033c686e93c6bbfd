"""A placement plan as an infrastructure plan, and the committed example made from one."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cp_harness import ControlPlane
from pydantic import ValidationError

from control_plane.db.models import PlacementPlan
from control_plane.example_plan import example_plan, render
from control_plane.infra_export import InfraExportError, InfraOptions, infra_plan
from control_plane.placement.problem import Assignment
from meridian.infra_plan import InfraPlan
from providers.catalog import load_catalog
from providers.regions import region_catalog

EXAMPLE = Path(__file__).parents[3] / "examples" / "plans" / "three-clouds.json"
OPTIONS = InfraOptions(control_plane_url="https://cp.example.com", endpoint_domain="api.example.com",
                       dns_zone="example.com", global_region="aws:us-east-1")


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_the_committed_example_is_what_the_placement_solver_makes_of_the_example_set():
    # Regenerate with: python -m control_plane.example_plan examples/plans/three-clouds.json
    assert EXAMPLE.read_text(encoding="utf-8") == render(example_plan())


def test_the_example_spans_three_providers_and_two_residency_zones():
    plan = InfraPlan.model_validate_json(EXAMPLE.read_text(encoding="utf-8"))
    assert {plan.region(g.region).provider for g in plan.groups} == {"aws", "gcp", "onprem"}
    zoned = {d.zone for d in plan.deployments} - {"global"}
    assert zoned == {"eu", "us"}
    for g in plan.groups:
        zone = plan.deployment(g.model).zone
        assert zone == "global" or zone in plan.zones_of(g.region)


def test_groups_carry_gpus_per_instance_availability_zones_and_headroom(catalog):
    a = Assignment(deployment="m", region="aws:us-east-1", instance_type="p5.48xlarge", sku="H100-80GB-SXM",
                   instances=3, replicas=24)
    plan = infra_plan([a], {"m": "us"}, region_catalog(), catalog, OPTIONS, plan_id="p1")
    (group,) = plan.groups
    assert (group.gpus_per_instance, group.instances, group.max_instances) == (8, 3, 6)
    region = plan.region("aws:us-east-1")
    # AWS zone IDs (the same physical zone in every account), as the catalog lists them.
    assert region.availability_zones and all(z.startswith("use1-az") for z in region.availability_zones)
    assert plan.global_.provider == "aws" and plan.plan_id == "p1"


def test_a_zoned_deployment_outside_its_zone_is_refused(catalog):
    a = Assignment(deployment="eu-model", region="aws:us-east-1", instance_type="p5.48xlarge",
                   sku="H100-80GB-SXM", instances=1, replicas=8)
    with pytest.raises(ValidationError, match="residency: deployment eu-model is zoned 'eu'"):
        infra_plan([a], {"eu-model": "eu"}, region_catalog(), catalog, OPTIONS)


def test_an_instance_type_the_region_does_not_offer_is_a_clear_error(catalog):
    a = Assignment(deployment="m", region="aws:us-east-1", instance_type="a3-highgpu-8g", sku="H100-80GB-SXM",
                   instances=1, replicas=8)
    with pytest.raises(InfraExportError, match="aws:us-east-1 offers no a3-highgpu-8g"):
        infra_plan([a], {"m": "global"}, region_catalog(), catalog, OPTIONS)


def test_a_disaggregated_plan_is_refused_rather_than_written_as_one_colocated_group(catalog):
    rows = [Assignment(deployment="m", region="aws:us-east-1", instance_type="p5.48xlarge", sku="H100-80GB-SXM",
                       instances=1, replicas=8, role=role) for role in ("prefill", "decode")]
    with pytest.raises(InfraExportError, match=r"prefill/decode-disaggregated deployments \(m\)"):
        infra_plan(rows, {"m": "global"}, region_catalog(), catalog, OPTIONS)


def test_the_global_stack_needs_a_cloud_region(catalog):
    options = InfraOptions(control_plane_url="https://cp", endpoint_domain="api.example.com",
                           dns_zone="example.com", global_region="onprem:tokyo-1")
    with pytest.raises(InfraExportError, match="needs a cloud region"):
        infra_plan([], {}, region_catalog(), catalog, options)


# --- POST /v1/placement/plans/{id}/infra --------------------------------------------------

INFRA_BODY = {"control_plane_url": "https://cp.example.com", "endpoint_domain": "api.example.com",
              "dns_zone": "example.com", "global_region": "aws:us-east-1",
              "kubernetes_sites": {"onprem:fra-dc1": {"namespace": "gpu"}}}


def store_plan(cp: ControlPlane, assignments: list[dict[str, object]]) -> str:
    now = datetime.now(UTC)
    plan_id = str(uuid.uuid4())
    with cp.app.state.ctx.write() as session:
        session.add(PlacementPlan(
            id=plan_id, status="preview", base_plan_id=None, cost_per_hour=1.0, assignments=assignments, diff={},
            explanation=None, solve_seconds=0.01, created_at=now, created_by="test",
        ))
    return plan_id


def assignment(model: str, region: str, instance_type: str, sku: str) -> dict[str, object]:
    return {"deployment": model, "region": region, "instance_type": instance_type, "sku": sku, "instances": 2,
            "replicas": 2, "spot": False, "cost_per_hour": 1.0}


async def test_a_stored_plan_is_exported_as_the_file_iac_synth_reads(cp: ControlPlane):
    for model, zone in (("eu-model", "eu"), ("any-model", "global")):
        r = await cp.http.put(f"/v1/deployments/{model}", json={"zone": zone, "max_replicas": 4}, headers=cp.admin)
        assert r.status_code == 201, r.text
    plan_id = store_plan(cp, [assignment("eu-model", "onprem:fra-dc1", "l40s-4x", "L40S-48GB"),
                              assignment("any-model", "aws:us-east-1", "p5.48xlarge", "H100-80GB-SXM")])
    r = await cp.http.post(f"/v1/placement/plans/{plan_id}/infra", json=INFRA_BODY, headers=cp.admin)
    assert r.status_code == 200, r.text
    plan = InfraPlan.model_validate(r.json())
    assert plan.plan_id == plan_id
    assert {(g.model, g.region, g.gpus_per_instance) for g in plan.groups} == {
        ("eu-model", "onprem:fra-dc1", 4), ("any-model", "aws:us-east-1", 8)}
    assert plan.deployment("eu-model").zone == "eu"
    (site,) = plan.onprem_sites
    assert site.kubernetes is not None and site.kubernetes.namespace == "gpu"


async def test_a_plan_that_would_break_residency_is_refused_with_a_problem(cp: ControlPlane):
    r = await cp.http.put("/v1/deployments/eu-model", json={"zone": "eu", "max_replicas": 4}, headers=cp.admin)
    assert r.status_code == 201, r.text
    # Written by hand (the solver never makes one like it): the eu deployment in a us region.
    plan_id = store_plan(cp, [assignment("eu-model", "aws:us-east-1", "p5.48xlarge", "H100-80GB-SXM")])
    r = await cp.http.post(f"/v1/placement/plans/{plan_id}/infra", json=INFRA_BODY, headers=cp.admin)
    body = cp.assert_problem(r, 400)
    assert "residency" in body["detail"]
    cp.assert_problem(await cp.http.post(f"/v1/placement/plans/{uuid.uuid4()}/infra", json=INFRA_BODY,
                                         headers=cp.admin), 404)
    cp.assert_problem(await cp.http.post(f"/v1/placement/plans/{plan_id}/infra", json={"dns_zone": "x.com"},
                                         headers=cp.admin), 422)
