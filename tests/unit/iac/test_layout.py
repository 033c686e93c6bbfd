"""What a plan becomes before cdktf: stacks, names, weight locations and replication edges."""

from __future__ import annotations

import pytest
from iac_plans import EU_MODEL, GLOBAL_MODEL, REGION_STACKS, US_MODEL, plan_dict

from iac import layout
from iac.layout import PlanError
from meridian.infra_plan import InfraPlan
from providers.aws import naming as aws_naming
from providers.gcp import naming as gcp_naming


def test_stacks_skip_inventory_only_sites(plan):
    names = [rs.name for rs in layout.region_stacks(plan)]
    assert names == REGION_STACKS


def test_the_global_region_gets_a_stack_even_without_groups():
    d = plan_dict()
    d["regions"].append(
        {"name": "aws:us-east-2", "provider": "aws", "location": "us-east-2", "zones": ["us"]}
    )
    d["global"]["region"] = "aws:us-east-2"
    stacks = {rs.name: rs for rs in layout.region_stacks(InfraPlan.model_validate(d))}
    assert stacks["aws-us-east-2"].groups == ()


def test_a_region_of_a_provider_without_stacks_is_refused():
    """The plan format takes any registered provider; iac says which ones it has stacks for."""
    d = plan_dict()
    d["regions"].append(
        {"name": "lattice:reykjavik-1", "provider": "lattice", "location": "reykjavik-1", "zones": ["us"]}
    )
    d["groups"].append({**d["groups"][0], "region": "lattice:reykjavik-1"})
    with pytest.raises(PlanError, match="no stacks for provider 'lattice' .it synthesises aws, gcp, onprem"):
        layout.region_stacks(InfraPlan.model_validate(d))


def test_replication_stays_inside_each_deployment_zone(plan):
    edges = {(r.model, r.source.name, r.destination.name) for r in layout.replications(plan)}
    assert edges == {
        (US_MODEL, "aws:us-east-1", "aws:us-west-2"),
        (EU_MODEL, "aws:eu-central-1", "aws:eu-west-1"),
        # The global model is in us-east-1, us-west-2 and eu-west-1: only the two us regions share a zone.
        (GLOBAL_MODEL, "aws:us-east-1", "aws:us-west-2"),
    }
    for r in layout.replications(plan):
        assert set(r.source.zones) & set(r.destination.zones)
        assert r.source.name < r.destination.name  # so stack dependencies never cycle


def test_push_targets_are_home_buckets_and_gcs_buckets(plan):
    targets = layout.push_targets(plan)
    assert (US_MODEL, "s3://acme-weights-us-east-1/models/llama-3-1-8b") in targets
    assert not any(uri.startswith("s3://acme-weights-us-west-2/") for _, uri in targets)  # a replica
    assert (GLOBAL_MODEL, "s3://acme-weights-eu-west-1/models/qwen-qwen2-5-72b-instruct") in targets
    assert (EU_MODEL, "gs://acme-weights-europe-west4/models/mistralai-mistral-7b-instruct-v0-3") in targets


def test_weights_key_follows_a_bucket_uri_else_the_model_slug(plan):
    assert layout.weights_key(plan.deployment(US_MODEL)) == "models/llama-3-1-8b"
    assert layout.weights_key(plan.deployment(GLOBAL_MODEL)) == "models/qwen-qwen2-5-72b-instruct"  # https://


def test_group_names_are_distinct_and_depend_on_the_groups_identity_only(plan):
    names = [layout.group_name(plan, g) for g in plan.groups if not g.region.startswith("onprem:")]
    # Auto Scaling groups and MIGs are regional: names are distinct within a region (and repeat across).
    assert len({(g.region, layout.group_name(plan, g)) for g in plan.groups}) == len(plan.groups)
    assert names.count("acme-qwen-qwen2-5-72b-instruct-g6e-12xlarge") == 3
    # Same identity, other sizes and another plan id: the same names, so the drivers find the groups.
    d = plan_dict()
    d["plan_id"] = "plan-43"
    for g in d["groups"]:
        g["instances"], g["max_instances"] = 1, 9
    again = InfraPlan.model_validate(d)
    assert [layout.group_name(again, g) for g in again.groups if not g.region.startswith("onprem:")] == names


def test_shared_names_come_from_the_drivers_naming(plan):
    g = next(g for g in plan.groups if g.instance_type == "p5.48xlarge")
    assert layout.launch_template_name(plan, "p5.48xlarge", False) == "acme-p5-48xlarge"
    assert layout.launch_template_name(plan, "g6.xlarge", True) == "acme-g6-xlarge-spot"
    assert layout.auto_scaling_group_name(plan, g) == aws_naming.auto_scaling_group_name(
        "acme", g.model, g.instance_type, g.spot
    )
    t4 = next(g for g in plan.groups if g.instance_type == "n1+2xT4")
    assert layout.mig_name(plan, t4) == gcp_naming.mig_name("acme", t4.model, "n1+2xT4", True)
    assert layout.base_instance_name(plan, t4) == gcp_naming.base_instance_name("acme", t4.model, t4.region, t4.instance_type, t4.spot)
    assert (
        layout.instance_template_name(plan, "g2-standard-48", True)
        == gcp_naming.instance_template_name("acme", "g2-standard-48", True)
        == "acme-g2-standard-48-spot"
    )


def test_spot_and_on_demand_groups_of_one_type_get_their_own_mig():
    d = plan_dict()
    a3 = next(g for g in d["groups"] if g["instance_type"] == "a3-highgpu-8g")
    d["groups"].append({**a3, "spot": True})
    p = InfraPlan.model_validate(d)
    (stack,) = [rs for rs in layout.region_stacks(p) if rs.name == "gcp-us-central1"]
    names = {layout.mig_name(p, g) for g in stack.groups if g.instance_type == "a3-highgpu-8g"}
    assert names == {
        "acme-meta-llama-llama-3-1-8b-instruct-a3-highgpu-8g",
        "acme-meta-llama-llama-3-1-8b-instruct-a3-highgpu-8g-spot",
    }


def test_models_that_slug_alike_in_one_region_are_refused():
    d = plan_dict()
    d["deployments"].append({"model": "Meta-Llama/Llama-3.1-8B-Instruct", "zone": "us"})
    p5 = next(g for g in d["groups"] if g["instance_type"] == "p5.48xlarge")
    d["groups"].append({**p5, "model": "Meta-Llama/Llama-3.1-8B-Instruct"})
    with pytest.raises(PlanError, match="in aws:us-east-1 would share"):
        layout.region_stacks(InfraPlan.model_validate(d))


def test_long_names_are_cut_with_a_hash():
    d = plan_dict()
    d["name"] = "a" + "b" * 60
    p = InfraPlan.model_validate(d)
    names = {layout.bucket_name(p, r) for r in p.regions}
    assert all(len(n) <= 63 for n in names) and len(names) == len(p.regions)


def test_a_name_gcp_refuses_is_a_plan_error(plan):
    d = plan_dict()
    d["name"] = "a-very-long-installation-name"  # GCP prefixes are at most 20 characters
    p = InfraPlan.model_validate(d)
    with pytest.raises(PlanError, match="instance template"):
        layout.instance_template_name(p, "a3-highgpu-8g", False)


@pytest.mark.parametrize(
    ("addresses", "records"),
    [
        (["203.0.113.10", "198.51.100.20"], [("A", ["198.51.100.20", "203.0.113.10"])]),
        (["2001:db8::1", "198.51.100.20"], [("A", ["198.51.100.20"]), ("AAAA", ["2001:db8::1"])]),
        (["router.example.net"], [("CNAME", ["router.example.net"])]),
        ([], []),
    ],
)
def test_dns_records(addresses, records):
    assert layout.dns_records(addresses) == records


def test_a_host_name_with_other_addresses_is_refused():
    with pytest.raises(PlanError, match="CNAME"):
        layout.dns_records(["router.example.net", "198.51.100.20"])


def test_terraform_expressions_in_text_stay_literal():
    assert layout.tf_literal("echo ${HOME} %{x}") == "echo $${HOME} %%{x}"
