"""Names and tags shared by the AWS driver and the iac stacks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from providers.aws import naming

# What AWS accepts: launch template names (3-128 of these), Auto Scaling group names (1-255).
LAUNCH_TEMPLATE_CHARS = re.compile(r"^[a-zA-Z0-9().\-/_]{3,128}$")
ASG_NAME = re.compile(r"^[^:]{1,255}$")


def test_launch_template_names_per_instance_type_and_market() -> None:
    assert naming.launch_template_name("meridian", "p5.48xlarge") == "meridian-p5-48xlarge"
    assert naming.launch_template_name("meridian", "p5.48xlarge", spot=True) == "meridian-p5-48xlarge-spot"
    assert naming.launch_template_name("Team_A.prod", "g6e.xlarge") == "team-a-prod-g6e-xlarge"
    assert LAUNCH_TEMPLATE_CHARS.match(naming.launch_template_name("meridian", "p4de.24xlarge", True))
    with pytest.raises(ValueError, match="no letter or digit"):
        naming.launch_template_name("--", "p5.48xlarge")
    with pytest.raises(ValueError, match="longer than 128"):
        naming.launch_template_name("x" * 120, "p5.48xlarge")


def test_group_names_come_from_model_instance_type_and_market_alone() -> None:
    # iac creates the group before the control plane has a group id: the name cannot hold one.
    model = "meta-llama/Llama-3.1-70B-Instruct"
    name = naming.auto_scaling_group_name("meridian", model, "p5.48xlarge", False)
    assert name == "meridian-meta-llama-llama-3-1-70b-instruct-p5-48xlarge"
    spot = naming.auto_scaling_group_name("meridian", model, "p5.48xlarge", True)
    assert spot == "meridian-meta-llama-llama-3-1-70b-instruct-p5-48xlarge-spot"
    assert naming.auto_scaling_group_name("meridian", "meta-llama/Llama-3.1-8B", "p5.48xlarge", False) != name
    assert naming.auto_scaling_group_name("meridian", model, "p4d.24xlarge", False) != name
    for n in (name, spot):
        assert ASG_NAME.match(n) and re.fullmatch(r"[a-z0-9-]+", n)


def test_long_models_are_cut_with_a_hash_so_models_sharing_a_prefix_never_collide() -> None:
    long_model = "org/" + "m" * 200
    a = naming.auto_scaling_group_name("meridian", long_model + "-v1", "p5.48xlarge", True)
    b = naming.auto_scaling_group_name("meridian", long_model + "-v2", "p5.48xlarge", True)
    assert a != b
    # stable: iac and the driver compute the same name
    assert a == naming.auto_scaling_group_name("meridian", long_model + "-v1", "p5.48xlarge", True)
    for n in (a, b):
        assert len(n) <= naming.AUTO_SCALING_GROUP_NAME_MAX and n.endswith("-p5-48xlarge-spot")
        model_part = n.removeprefix("meridian-").removesuffix("-p5-48xlarge-spot")
        assert len(model_part) <= naming.MODEL_SLUG_MAX and re.fullmatch(r"org-m+-[0-9a-f]{8}", model_part)
    # A slug that fits is kept whole, without a hash.
    exact = "x" * naming.MODEL_SLUG_MAX
    kept = naming.auto_scaling_group_name("meridian", exact, "g5.xlarge", False)
    assert kept == f"meridian-{exact}-g5-xlarge"
    # Models of symbols only still get distinct names.
    snow = naming.auto_scaling_group_name("meridian", "☃/☃", "g5.xlarge", False)
    assert re.fullmatch(r"meridian-model-[0-9a-f]{8}-g5-xlarge", snow)
    assert naming.auto_scaling_group_name("meridian", "☂", "g5.xlarge", False) != snow
    with pytest.raises(ValueError, match="longer than 255"):
        naming.auto_scaling_group_name("p" * 200, "m" * 100, "p5.48xlarge", False)


def test_tags_the_driver_and_iac_agree_on() -> None:
    assert naming.group_tags("g-1", "llama") == {
        "meridian:group-id": "g-1", "meridian:model": "llama", "meridian:role": "gpu-node"}
    assert naming.subnet_tags() == {"meridian:role": "gpu-subnet"}


def test_naming_imports_no_cloud_sdk() -> None:
    code = ("import sys, providers.aws.naming; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
