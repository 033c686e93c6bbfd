"""Synthesised Terraform JSON of a three-cloud plan: stacks, key properties, determinism, residency,
diffs and the CLI. Loading the provider bindings (jsii) takes about a minute; a synth about a second,
so the module synthesises the fixture plan once and shares it."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from iac_plans import EU_MODEL, GLOBAL_MODEL, REGION_STACKS, US_MODEL, plan_dict
from rich.console import Console
from typer.testing import CliRunner

from iac import layout
from iac.app import build_app, synth
from iac.cli import app as iac_app
from iac.diff import diff_stacks, diff_table, load_stacks
from iac.layout import PlanError
from iac.onprem import group_label
from meridian.contracts import GLOBAL_ZONE
from meridian.infra_plan import InfraPlan
from providers.aws import naming as aws_naming
from providers.gcp import naming as gcp_naming

runner = CliRunner()
Stacks = dict[str, dict[str, Any]]

EXAMPLE_PLAN = Path(__file__).resolve().parents[3] / "examples" / "plans" / "three-clouds.json"
STACK_NAMES = sorted([*REGION_STACKS, "global"])


@pytest.fixture(scope="module")
def out_dir(plan: InfraPlan, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "cdktf.out"
    synth(plan, out)
    return out


@pytest.fixture(scope="module")
def stacks(out_dir: Path) -> Stacks:
    return load_stacks(out_dir)


def _resources(stack: dict[str, Any], rtype: str) -> dict[str, dict[str, Any]]:
    return stack.get("resource", {}).get(rtype, {})


def _by_name(stack: dict[str, Any], rtype: str, name: str) -> dict[str, Any]:
    found = [r for r in _resources(stack, rtype).values() if r.get("name") == name]
    assert len(found) == 1, f"{rtype} {name}: {len(found)} found"
    return found[0]


def _modified(**changes: Any) -> InfraPlan:
    d = plan_dict()
    for key, value in changes.items():
        d[key] = value
    return InfraPlan.model_validate(d)


# --- stacks ----------------------------------------------------------------------------


def test_one_stack_per_provider_region_plus_global(out_dir, plan):
    paths = [p.relative_to(out_dir).as_posix() for p in sorted((out_dir / "stacks").glob("*/cdk.tf.json"))]
    assert paths == [f"stacks/{n}/cdk.tf.json" for n in STACK_NAMES]  # no stack for the inventory-only site
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["stacks"]["global"]["dependencies"] == ["aws-us-east-1"]
    # Replication sources are applied after the buckets they copy to.
    assert manifest["stacks"]["aws-us-east-1"]["dependencies"] == ["aws-us-west-2"]
    assert manifest["stacks"]["aws-eu-central-1"]["dependencies"] == ["aws-eu-west-1"]


def test_stacks_use_a_relative_local_backend(stacks):
    for name, stack in stacks.items():
        assert stack["terraform"]["backend"] == {"local": {"path": f"terraform.{name}.tfstate"}}


def test_cdktf_testing_sees_the_key_aws_resources(plan, tmp_path):
    from cdktf import Testing

    _, built = build_app(plan, tmp_path)
    synthesised = Testing.synth(built["aws-us-east-1"])
    assert Testing.to_have_provider_with_properties(synthesised, "aws", {"region": "us-east-1"})
    assert Testing.to_have_data_source_with_properties(
        synthesised, "aws_ami", {"owners": ["amazon"], "most_recent": True}
    )
    assert Testing.to_have_resource_with_properties(
        synthesised,
        "aws_autoscaling_group",
        {"desired_capacity": 2, "max_size": 4, "min_size": 0, "region": "us-east-1"},
    )
    assert Testing.to_have_resource_with_properties(
        synthesised,
        "aws_s3_bucket_public_access_block",
        {
            "block_public_acls": True,
            "block_public_policy": True,
            "ignore_public_acls": True,
            "restrict_public_buckets": True,
        },
    )
    assert not Testing.to_have_resource(synthesised, "google_storage_bucket")


# --- AWS -------------------------------------------------------------------------------


def test_auto_scaling_groups_match_the_plan(plan, stacks):
    aws_groups = [g for g in plan.groups if g.region.startswith("aws:")]
    assert len(aws_groups) == 7
    for g in aws_groups:
        asg = _by_name(
            stacks[layout.stack_name(g.region)],
            "aws_autoscaling_group",
            layout.auto_scaling_group_name(plan, g),
        )
        assert (asg["desired_capacity"], asg["max_size"], asg["min_size"]) == (
            g.instances,
            g.max_instances,
            0,
        )
        tags = {t["key"]: t["value"] for t in asg["tag"]}
        assert tags["meridian:model"] == g.model and tags["meridian:role"] == "gpu-node"
        assert "meridian:group-id" not in tags  # the driver adds it when it adopts the group
        assert all(t["propagate_at_launch"] for t in asg["tag"])
        assert asg["vpc_zone_identifier"] == [
            f"${{aws_subnet.gpu_subnet_{i}.id}}" for i in range(len(plan.region(g.region).availability_zones))
        ]
        if g.spot:
            assert "launch_template" not in asg
            policy = asg["mixed_instances_policy"]
            assert policy["instances_distribution"]["on_demand_percentage_above_base_capacity"] == 0
            assert policy["instances_distribution"]["on_demand_base_capacity"] == 0
            assert policy["launch_template"]["override"][0]["instance_type"] == g.instance_type
        else:
            assert "mixed_instances_policy" not in asg and asg["launch_template"]["version"] == "$Default"


def test_gpu_subnets_carry_the_role_tag_the_driver_looks_for(stacks, plan):
    for stack, key in (("aws-us-west-2", "availability_zone"), ("aws-eu-central-1", "availability_zone_id")):
        subnets = _resources(stacks[stack], "aws_subnet").values()
        gpu = [s for s in subnets if s["tags"].get("meridian:role") == "gpu-subnet"]
        region = plan.region(stack.replace("-", ":", 1))
        assert sorted(s[key] for s in gpu) == region.availability_zones
        assert all(s["tags"]["meridian:tier"] == "private" for s in gpu)


def test_launch_templates_boot_the_node_against_the_control_plane(plan, stacks):
    stack = stacks["aws-eu-west-1"]
    templates = {t["name"]: t for t in _resources(stack, "aws_launch_template").values()}
    assert sorted(templates) == ["acme-g6e-12xlarge", "acme-p4de-24xlarge"]
    for template in templates.values():
        user_data = base64.b64decode(template["user_data"]).decode()
        assert user_data.startswith("#cloud-config")
        run = yaml.safe_load(user_data)["write_files"][0]["content"]
        assert "export MERIDIAN_NODE_CONTROL_PLANE_URL=https://cp.acme.example.com" in run
        assert "export MERIDIAN_NODE_REGION=aws:eu-west-1" in run
        assert (
            f"{EU_MODEL}) MODEL_URI=s3://acme-weights-eu-west-1/models/mistralai-mistral-7b-instruct-v0-3"
            in run
        )
        assert "exec /opt/meridian/bin/meridian node run" in run
        assert "meridian[vllm]==0.1.0" in user_data
        assert template["metadata_options"]["http_tokens"] == "required"
        assert template["metadata_options"]["instance_metadata_tags"] == "enabled"
        assert template["block_device_mappings"][0]["ebs"]["encrypted"] == "true"


def test_security_group_opens_node_ports_to_the_vpc_and_routers_only(stacks):
    sg = _by_name(stacks["aws-us-east-1"], "aws_security_group", "acme-node-us-east-1")
    assert sorted(rule["from_port"] for rule in sg["ingress"]) == [5557, 5558, 8000]
    for rule in sg["ingress"]:
        assert rule["from_port"] == rule["to_port"] and rule["protocol"] == "tcp"
        assert rule["cidr_blocks"] == "${concat([aws_vpc.vpc.cidr_block], var.router_cidrs)}"


def _policies(stacks: Stacks) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for name, stack in stacks.items():
        for rtype in ("aws_iam_role_policy", "aws_s3_bucket_policy"):
            for rid, res in _resources(stack, rtype).items():
                out.append((name, rid, json.loads(res["policy"])))
    return out


def test_iam_policies_name_their_resources(stacks):
    policies = _policies(stacks)
    assert len(policies) >= 10
    for stack, rid, policy in policies:
        for statement in policy["Statement"]:
            resources = (
                statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            )
            assert resources and "*" not in resources, (stack, rid, statement)
            assert all(r.startswith("arn:aws:") for r in resources)


def test_node_role_reads_only_its_region_bucket_and_the_cluster_token(stacks):
    policy = json.loads(
        _resources(stacks["aws-eu-central-1"], "aws_iam_role_policy")["node_policy"]["policy"]
    )
    actions = sorted(a for s in policy["Statement"] for a in s["Action"])
    assert actions == ["s3:GetObject", "s3:ListBucket", "ssm:GetParameter"]
    resources = [r for s in policy["Statement"] for r in s["Resource"]]
    assert all("acme-weights-eu-central-1" in r for r in resources if ":s3:" in r)
    assert "arn:aws:s3:::acme-weights-eu-central-1/models/mistralai-mistral-7b-instruct-v0-3/*" in resources
    assert any(r.endswith(":parameter/acme/cluster-token") for r in resources)


def test_weights_buckets_are_private_versioned_and_encrypted(stacks):
    aws_stacks = [s for n, s in stacks.items() if n.startswith("aws-")]
    for stack in aws_stacks:
        assert len(_resources(stack, "aws_s3_bucket")) == 1
        (block,) = _resources(stack, "aws_s3_bucket_public_access_block").values()
        assert all(
            block[k] is True
            for k in (
                "block_public_acls",
                "block_public_policy",
                "ignore_public_acls",
                "restrict_public_buckets",
            )
        )
        (versioning,) = _resources(stack, "aws_s3_bucket_versioning").values()
        assert versioning["versioning_configuration"]["status"] == "Enabled"
        (sse,) = _resources(stack, "aws_s3_bucket_server_side_encryption_configuration").values()
        assert sse["rule"][0]["apply_server_side_encryption_by_default"]["sse_algorithm"] == "AES256"
    for name in ("gcp-europe-west4", "gcp-us-central1"):
        (bucket,) = _resources(stacks[name], "google_storage_bucket").values()
        assert (
            bucket["public_access_prevention"] == "enforced" and bucket["uniform_bucket_level_access"] is True
        )
        assert bucket["location"] == name.removeprefix("gcp-").upper()


def test_replication_copies_model_prefixes_to_same_zone_buckets(stacks):
    (config,) = _resources(stacks["aws-us-east-1"], "aws_s3_bucket_replication_configuration").values()
    rules = {r["filter"]["prefix"]: r["destination"]["bucket"] for r in config["rule"]}
    assert rules == {
        "models/llama-3-1-8b/": "arn:aws:s3:::acme-weights-us-west-2",
        "models/qwen-qwen2-5-72b-instruct/": "arn:aws:s3:::acme-weights-us-west-2",
    }
    assert sorted(r["priority"] for r in config["rule"]) == [0, 1]
    # eu-west-1 holds the global model too, but no other AWS region of its zone runs it: no replication.
    assert not _resources(stacks["aws-eu-west-1"], "aws_s3_bucket_replication_configuration")


# --- GCP -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stack", "name", "machine_type", "accelerator", "count", "spot"),
    [
        ("gcp-europe-west4", "acme-g2-standard-48-spot", "g2-standard-48", "nvidia-l4", 4, True),
        ("gcp-europe-west4", "acme-a2-ultragpu-1g", "a2-ultragpu-1g", "nvidia-a100-80gb", 1, False),
        ("gcp-us-central1", "acme-a3-highgpu-8g", "a3-highgpu-8g", "nvidia-h100-80gb", 8, False),
        # The catalog's "n1+2xT4" offering: an n1 host with two T4s attached.
        ("gcp-us-central1", "acme-n1-2xt4-spot", "n1-standard-16", "nvidia-tesla-t4", 2, True),
    ],
)
def test_instance_templates_attach_the_skus_gpus(stacks, stack, name, machine_type, accelerator, count, spot):
    template = _by_name(stacks[stack], "google_compute_region_instance_template", name)
    assert template["machine_type"] == machine_type
    assert template["guest_accelerator"] == [{"count": count, "type": accelerator}]
    assert template["region"] == stack.removeprefix("gcp-")
    scheduling = template["scheduling"]
    assert scheduling["on_host_maintenance"] == "TERMINATE"
    assert scheduling["provisioning_model"] == ("SPOT" if spot else "STANDARD")
    assert scheduling["preemptible"] is spot
    assert "https://cp.acme.example.com" in template["metadata"]["startup-script"]
    assert "access_config" not in template["network_interface"][0]  # no public address


def test_migs_match_the_plan(plan, stacks):
    gcp_groups = [g for g in plan.groups if g.region.startswith("gcp:")]
    for g in gcp_groups:
        mig = _by_name(
            stacks[layout.stack_name(g.region)],
            "google_compute_region_instance_group_manager",
            layout.mig_name(plan, g),
        )
        assert mig["target_size"] == g.instances
        assert mig["distribution_policy_zones"] == plan.region(g.region).availability_zones
        assert mig["all_instances_config"]["metadata"] == {"meridian-model": g.model}
        assert mig["all_instances_config"]["labels"] == {
            "meridian-model": gcp_naming.label_value(g.model),
            "meridian-role": "gpu-node",
        }
        template = layout.instance_template_name(plan, g.instance_type, g.spot)
        assert mig["version"][0]["instance_template"] == (
            f"${{google_compute_region_instance_template.{layout.tf_id('it', template)}.self_link}}"
        )


def test_example_plans_n1_offering_becomes_an_n1_host_with_attached_t4s(tmp_path):
    example = InfraPlan.model_validate_json(EXAMPLE_PLAN.read_text())
    assert any(g.instance_type == "n1+4xT4" for g in example.groups)
    synth(example, tmp_path / "out")
    stack = load_stacks(tmp_path / "out")["gcp-us-west1"]
    template = _by_name(stack, "google_compute_region_instance_template", "meridian-n1-4xt4")
    assert template["machine_type"] == "n1-standard-32"
    assert template["guest_accelerator"] == [{"count": 4, "type": "nvidia-tesla-t4"}]
    (mig,) = _resources(stack, "google_compute_region_instance_group_manager").values()
    assert (
        mig["name"] == gcp_naming.mig_name("meridian", "llama-3.1-8b", "n1+4xT4", False)
        and mig["target_size"] == 6
    )


def test_gcp_node_account_reads_only_its_bucket(stacks):
    stack = stacks["gcp-europe-west4"]
    (member,) = _resources(stack, "google_storage_bucket_iam_member").values()
    assert member["role"] == "roles/storage.objectViewer"
    assert member["bucket"] == "${google_storage_bucket.weights.name}"
    assert not _resources(stack, "google_project_iam_member")


# --- names and ownership shared with the drivers -----------------------------------------


def _template_name(stack: dict[str, Any], rtype: str, reference: str) -> str:
    """The name of the template a "${<rtype>.<id>.<attr>}" reference points at."""
    rid = re.fullmatch(rf"\$\{{{rtype}\.(\w+)\.\w+\}}", reference)
    assert rid, reference
    return _resources(stack, rtype)[rid.group(1)]["name"]


def test_groups_and_templates_carry_the_names_the_drivers_compute(plan, stacks):
    """The drivers adopt what Terraform created by name alone: every group's synthesised ASG/MIG and its
    template must be named as providers.*.naming names them from the same (prefix, model, type, spot)."""
    checked = 0
    for g in plan.groups:
        stack = stacks.get(layout.stack_name(g.region), {})
        if g.region.startswith("aws:"):
            asg = _by_name(
                stack,
                "aws_autoscaling_group",
                aws_naming.auto_scaling_group_name("acme", g.model, g.instance_type, g.spot),
            )
            spec = (
                asg["mixed_instances_policy"]["launch_template"]["launch_template_specification"]
                if g.spot
                else asg["launch_template"]
            )
            ref = spec.get("launch_template_id") or spec["id"]
            assert _template_name(stack, "aws_launch_template", ref) == aws_naming.launch_template_name(
                "acme", g.instance_type, g.spot
            )
            assert asg["lifecycle"] == {"ignore_changes": ["desired_capacity", "max_size", "tag"]}
            checked += 1
        elif g.region.startswith("gcp:"):
            mig = _by_name(
                stack,
                "google_compute_region_instance_group_manager",
                gcp_naming.mig_name("acme", g.model, g.instance_type, g.spot),
            )
            assert mig["base_instance_name"] == gcp_naming.base_instance_name("acme", g.model, g.region, g.instance_type, g.spot)
            ref = mig["version"][0]["instance_template"]
            assert _template_name(
                stack, "google_compute_region_instance_template", ref
            ) == gcp_naming.instance_template_name("acme", g.instance_type, g.spot)
            assert mig["lifecycle"] == {"ignore_changes": ["target_size"]}
            checked += 1
    assert checked == 11


def test_only_the_groups_leave_anything_to_the_control_plane(stacks):
    """Every other resource Terraform keeps converged: none of them ignores changes."""
    for name, stack in stacks.items():
        for rtype, blocks in stack.get("resource", {}).items():
            for rid, attrs in blocks.items():
                if rtype not in ("aws_autoscaling_group", "google_compute_region_instance_group_manager"):
                    assert "lifecycle" not in attrs, f"{name}/{rtype}.{rid}"


# --- on-prem ---------------------------------------------------------------------------


def test_daemon_set_runs_the_agent_on_labelled_gpu_hosts(plan, stacks):
    stack = stacks["onprem-tokyo-1"]
    assert stack["provider"]["kubernetes"][0]["config_context"] == "tokyo-gpu"
    (namespace,) = _resources(stack, "kubernetes_namespace_v1").values()
    assert namespace["metadata"]["name"] == "meridian-gpu"
    (ds,) = _resources(stack, "kubernetes_daemon_set_v1").values()
    group = next(g for g in plan.groups if g.region == "onprem:tokyo-1")
    pod = ds["spec"]["template"]["spec"]
    assert pod["node_selector"] == {
        "nvidia.com/gpu.present": "true",
        "meridian.io/node-group": group_label(group),
    }
    (container,) = pod["container"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MERIDIAN_NODE_CONTROL_PLANE_URL"] == "https://cp.acme.example.com"
    assert env["MERIDIAN_NODE_REGION"] == "onprem:tokyo-1"
    assert env["MERIDIAN_NODE_MODEL_NAME"] == GLOBAL_MODEL
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    token = next(e for e in container["env"] if e["name"] == "MERIDIAN_CLUSTER_TOKEN")
    assert token["value_from"]["secret_key_ref"] == {"key": "token", "name": "acme-cluster-token"}


# --- global ----------------------------------------------------------------------------


def test_global_state_is_private_and_encrypted(stacks):
    stack = stacks["global"]
    (db,) = _resources(stack, "aws_db_instance").values()
    assert db["publicly_accessible"] is False and db["storage_encrypted"] is True
    assert db["manage_master_user_password"] is True and "password" not in db
    (redis,) = _resources(stack, "aws_elasticache_replication_group").values()
    assert redis["transit_encryption_enabled"] is True and redis["at_rest_encryption_enabled"] == "true"
    (record,) = _resources(stack, "aws_route53_record").values()
    assert (record["name"], record["type"], record["records"]) == (
        "api.acme.example.com",
        "A",
        ["198.51.100.20", "203.0.113.10"],
    )
    assert stack["data"]["aws_route53_zone"]["zone"]["name"] == "acme.example.com"


def test_global_stack_on_gcp_uses_cloud_sql_memorystore_and_cloud_dns(tmp_path):
    d = plan_dict()
    d["global"].update(provider="gcp", region="gcp:europe-west4", router_addresses=["lb.acme.example.net"])
    synth(InfraPlan.model_validate(d), tmp_path / "out")
    stack = load_stacks(tmp_path / "out")["global"]
    (db,) = _resources(stack, "google_sql_database_instance").values()
    ip = db["settings"]["ip_configuration"]
    assert ip["ipv4_enabled"] is False and ip["ssl_mode"] == "ENCRYPTED_ONLY"
    assert db["region"] == "europe-west4" and db["deletion_protection"] is True
    (redis,) = _resources(stack, "google_redis_instance").values()
    assert redis["transit_encryption_mode"] == "SERVER_AUTHENTICATION" and redis["auth_enabled"] is True
    (record,) = _resources(stack, "google_dns_record_set").values()
    assert (record["name"], record["type"], record["rrdatas"]) == (
        "api.acme.example.com.",
        "CNAME",
        ["lb.acme.example.net."],
    )


# --- determinism and residency ------------------------------------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_plan_gives_byte_identical_output(plan, out_dir, tmp_path):
    again = tmp_path / "elsewhere" / "out"
    synth(plan, again)
    assert _tree(again) == _tree(out_dir)
    assert str(out_dir) not in "".join(v.decode() for v in _tree(out_dir).values())


def test_synth_into_a_previous_output_replaces_it(plan, tmp_path):
    out = tmp_path / "out"
    d = plan_dict()
    d["groups"] = [g for g in d["groups"] if g["region"] != "gcp:us-central1"]
    synth(InfraPlan.model_validate(d), out)
    assert not (out / "stacks" / "gcp-us-central1").exists()
    synth(plan, out)
    assert (out / "stacks" / "gcp-us-central1" / "cdk.tf.json").is_file()


def test_synth_refuses_a_directory_it_did_not_write(plan, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PlanError, match="not empty"):
        synth(plan, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _stack_region(stack: dict[str, Any]) -> str:
    return stack["locals"]["meridian_region"]


def _resource_location(stack: dict[str, Any], attrs: dict[str, Any]) -> str | None:
    """The cloud location a resource names itself, else its provider's."""
    for key in ("region", "location"):
        if isinstance(attrs.get(key), str):
            return attrs[key].lower()
    providers = stack.get("provider", {})
    for cloud in ("aws", "google"):
        if cloud in providers:
            return providers[cloud][0]["region"]
    return None


def _text(attrs: dict[str, Any]) -> str:
    """Everything a resource says, user data decoded."""
    text = json.dumps(attrs)
    if isinstance(attrs.get("user_data"), str):
        text += base64.b64decode(attrs["user_data"]).decode()
    return text


def test_no_resource_of_a_zoned_deployment_leaves_its_zone(plan, stacks):
    region_of_location = {(r.provider, r.location): r for r in plan.regions}
    bucket_zones = {}
    for stack in stacks.values():
        region = plan.region(_stack_region(stack))
        for attrs in [
            *_resources(stack, "aws_s3_bucket").values(),
            *_resources(stack, "google_storage_bucket").values(),
        ]:
            bucket_zones[attrs.get("bucket") or attrs["name"]] = set(region.zones)
    markers = {d.model: {d.model, layout.slug(d.model), layout.weights_key(d)} for d in plan.deployments}
    seen = {d.model: set() for d in plan.deployments}
    for name, stack in stacks.items():
        region = plan.region(_stack_region(stack))
        for section in ("resource", "data"):
            for rtype, blocks in stack.get(section, {}).items():
                for rid, attrs in blocks.items():
                    where = f"{name}/{rtype}.{rid}"
                    location = _resource_location(stack, attrs)
                    if region.provider != "onprem":  # every resource of a region stack is in that region
                        assert location == region.location, where
                        assert region_of_location[(region.provider, location)] == region
                    text = _text(attrs)
                    for d in plan.deployments:
                        if not any(m in text for m in markers[d.model]):
                            continue
                        seen[d.model].add(name)
                        if d.zone == GLOBAL_ZONE:
                            continue
                        assert d.zone in region.zones, f"{where} serves {d.model} ({d.zone}) in {region.name}"
                        for bucket in re.findall(r"acme-weights-[a-z0-9-]+", text):
                            assert d.zone in bucket_zones[bucket], f"{where}: {d.model} reaches {bucket}"
    assert seen[EU_MODEL] == {"aws-eu-central-1", "aws-eu-west-1", "gcp-europe-west4"}
    assert seen[US_MODEL] == {"aws-us-east-1", "aws-us-west-2", "gcp-us-central1"}
    assert "onprem-tokyo-1" in seen[GLOBAL_MODEL]


# --- diff ------------------------------------------------------------------------------


def test_diff_reports_a_resized_group_and_an_added_one(plan, out_dir, tmp_path):
    d = plan_dict()
    p5 = next(g for g in d["groups"] if g["instance_type"] == "p5.48xlarge")
    p5["instances"] = 3
    added = {
        "model": EU_MODEL,
        "region": "aws:eu-west-1",
        "instance_type": "g6e.12xlarge",
        "sku": "L40S-48GB",
        "gpus_per_instance": 4,
        "instances": 2,
        "max_instances": 2,
        "spot": True,
    }
    d["groups"].append(added)
    new = InfraPlan.model_validate(d)
    synth(new, tmp_path / "new")
    diff = diff_stacks(out_dir, tmp_path / "new")
    (resized,) = diff.find("aws-us-east-1", "aws_autoscaling_group")
    assert resized.kind == "changed" and resized.attributes == {"desired_capacity": (2, 3)}
    asg_name = layout.auto_scaling_group_name(new, new.groups[-1])
    (added_asg,) = diff.find("aws-eu-west-1", "aws_autoscaling_group")
    assert (
        added_asg.kind == "added"
        and added_asg.address == f"aws_autoscaling_group.{layout.tf_id('asg', asg_name)}"
    )
    kinds = {(c.stack, c.resource_type, c.kind) for c in diff.changes}
    assert ("aws-eu-west-1", "aws_launch_template", "added") in kinds  # the spot template is new there
    assert not diff.added_stacks and not diff.removed_stacks
    console = Console(record=True, width=200)
    console.print(diff_table(diff))
    # Terraform leaves an existing group's size to the control plane; the diff says so.
    assert resized.ignored == frozenset({"desired_capacity"})
    assert "desired_capacity: 2 → 3 (ignored once created)" in console.export_text()


def test_diff_of_a_plan_with_itself_is_empty(out_dir):
    assert diff_stacks(out_dir, out_dir).empty


# --- CLI -------------------------------------------------------------------------------


def _write_plan(path: Path, d: dict[str, Any]) -> Path:
    path.write_text(json.dumps(d))
    return path


def test_cli_synth_writes_the_stacks_and_lists_them(tmp_path, out_dir):
    plan_file = _write_plan(tmp_path / "plan.json", plan_dict())
    result = runner.invoke(
        iac_app, ["synth", "--plan", str(plan_file), "--out", str(tmp_path / "out")], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert _tree(tmp_path / "out") == _tree(out_dir)
    for name in STACK_NAMES:
        assert name in result.output
    assert "s3://acme-weights-us-east-1/models/llama-3-1-8b" in result.output  # where to push weights
    # The drivers name groups from their own prefix: the hint says what it must be.
    hint = " ".join(result.output.split())
    assert "MERIDIAN_PROVIDER_AWS_NAME_PREFIX and MERIDIAN_PROVIDER_GCP_NAME_PREFIX to 'acme'" in hint


def test_cli_refuses_a_plan_that_breaks_residency(tmp_path):
    d = plan_dict()
    eu_group = next(
        g for g in d["groups"] if g["model"] == EU_MODEL and g["instance_type"] == "p4de.24xlarge"
    )
    eu_group["region"] = "aws:us-east-1"  # the eu model's group in a us region
    result = runner.invoke(
        iac_app, ["synth", "--plan", str(_write_plan(tmp_path / "p.json", d)), "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 2
    assert "residency" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "plan file not found"),
        ("{not json", "invalid plan"),
        ('{"format": "meridian-infra-plan/v1"}', "control_plane_url: Field required"),
    ],
)
def test_cli_reports_unreadable_plans_in_one_line(tmp_path, content, message):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(iac_app, ["synth", "--plan", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_cli_reports_a_plan_iac_cannot_build(tmp_path):
    d = plan_dict()
    a3 = next(g for g in d["groups"] if g["instance_type"] == "a3-highgpu-8g")
    a3["gpus_per_instance"] = 4
    result = runner.invoke(
        iac_app, ["synth", "--plan", str(_write_plan(tmp_path / "p.json", d)), "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 2
    assert "a3-highgpu-8g carries 8 GPUs" in result.output and "Traceback" not in result.output


def test_cli_diff_shows_the_changed_group(tmp_path):
    old = _write_plan(tmp_path / "a.json", plan_dict())
    d = plan_dict()
    next(g for g in d["groups"] if g["instance_type"] == "g6.xlarge")["max_instances"] = 9
    new = _write_plan(tmp_path / "b.json", d)
    result = runner.invoke(iac_app, ["diff", "--old", str(old), "--new", str(new)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "aws-eu-central-1" in result.output and "max_size: 6 → 9 (ignored once created)" in result.output
    assert "1 changed" in result.output
