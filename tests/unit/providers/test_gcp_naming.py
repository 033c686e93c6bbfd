"""Names of Meridian's GCP resources (shared with the Terraform stacks) and GPU quota metrics."""

from __future__ import annotations

import re

import pytest

from meridian.contracts import NODE_ID_PATTERN
from providers.errors import ProviderError
from providers.gcp import naming
from providers.gcp.quotas import gpu_quota_metric, gpu_quotas

GROUP = "1b9d6bcd-bbfd-4b2d-9b5d-ab8dfbbd4bed"
LONG_MODEL = "organisation-with-a-long-name/Some-Very-Long-Model-Name-v2.5-Instruct-1M-context-AWQ"
LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


def test_template_names_per_machine_type_and_spot() -> None:
    assert naming.instance_template_name("meridian", "a3-highgpu-8g", spot=False) == "meridian-a3-highgpu-8g"
    assert (
        naming.instance_template_name("meridian", "a3-highgpu-8g", spot=True) == "meridian-a3-highgpu-8g-spot"
    )
    assert naming.instance_template_name("Prod", "n1+4xT4", spot=False) == "prod-n1-4xt4"


def test_long_template_names_stay_valid_and_distinct() -> None:
    prefix = "a-twenty-char-prefix"
    a = naming.instance_template_name(prefix, "x" * 40 + "-1g", spot=True)
    b = naming.instance_template_name(prefix, "x" * 40 + "-2g", spot=True)

    assert a != b
    assert all(naming.RFC1035.match(n) and len(n) <= 63 for n in (a, b))


def test_mig_names_come_from_model_machine_type_and_market_alone() -> None:
    # iac creates the MIG before the control plane has a group id: the name cannot hold one.
    name = naming.mig_name("meridian", "meta-llama/Llama-3.1-8B", "g2-standard-8", spot=False)
    spot = naming.mig_name("meridian", "meta-llama/Llama-3.1-8B", "g2-standard-8", spot=True)

    assert name == "meridian-meta-llama-llama-3-1-8b-g2-standard-8"
    assert spot == "meridian-meta-llama-llama-3-1-8b-g2-standard-8-spot"
    base = naming.base_instance_name("meridian", "meta-llama/Llama-3.1-8B", "gcp:us-central1", "g2-standard-8", False)
    assert re.fullmatch(r"meridian-meta-llama-llama-3-1-8b-[0-9a-f]{8}", base)


def test_every_group_of_a_model_has_its_own_instance_names() -> None:
    # VM names are node ids: two MIGs of one model must never draw from the same name space.
    model = "meta-llama/Llama-3.1-8B"
    bases = {
        naming.base_instance_name("meridian", model, region, machine, spot)
        for region in ("gcp:us-central1", "gcp:europe-west4")
        for machine in ("g2-standard-8", "a3-highgpu-8g")
        for spot in (False, True)
    }
    assert len(bases) == 8
    assert naming.base_instance_name("meridian", model, "gcp:us-central1", "g2-standard-8", False) in bases


def test_long_models_are_cut_with_a_hash_so_models_sharing_a_prefix_never_collide() -> None:
    other = LONG_MODEL.replace("v2.5", "v2.6")
    a = naming.mig_name("a-twenty-char-prefix", LONG_MODEL, "a3-ultragpu-8g-nolssd", spot=True)
    b = naming.mig_name("a-twenty-char-prefix", other, "a3-ultragpu-8g-nolssd", spot=True)
    base_a = naming.base_instance_name("a-twenty-char-prefix", LONG_MODEL, "gcp:us-central1", "a3-ultragpu-8g", True)
    base_b = naming.base_instance_name("a-twenty-char-prefix", other, "gcp:us-central1", "a3-ultragpu-8g", True)

    assert a != b and base_a != base_b
    # stable: iac and the driver compute the same name
    assert a == naming.mig_name("a-twenty-char-prefix", LONG_MODEL, "a3-ultragpu-8g-nolssd", spot=True)
    assert a.startswith("a-twenty-char-prefix-organi") and a.endswith("-a3-ultragpu-8g-nolssd-spot")
    assert re.search(r"-[0-9a-f]{8}-a3-ultragpu", a) and re.search(r"-[0-9a-f]{8}$", base_a)
    assert all(naming.RFC1035.match(n) and len(n) <= 63 for n in (a, b))
    assert all(len(n) <= naming.BASE_INSTANCE_NAME_MAX and naming.RFC1035.match(n) for n in (base_a, base_b))
    # the MIG names its VMs "<base>-xxxx": those are Meridian node ids
    instance = f"{base_a}-x7k2"
    assert len(instance) <= 63 and re.match(NODE_ID_PATTERN, instance) and naming.RFC1035.match(instance)
    # models of symbols only still get distinct, valid names
    snow = naming.mig_name("meridian", "☃", "g2-standard-8", spot=False)
    assert re.fullmatch(r"meridian-model-[0-9a-f]{8}-g2-standard-8", snow)
    assert naming.mig_name("meridian", "☂", "g2-standard-8", spot=False) != snow


@pytest.mark.parametrize("prefix", ["", "9lives", "a" * 21, "---"])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        naming.mig_name(prefix, "m", "g2-standard-8", spot=False)


def test_labels_are_valid_label_values() -> None:
    labels = naming.group_labels(LONG_MODEL, GROUP)

    assert set(labels) == {naming.LABEL_GROUP_ID, naming.LABEL_MODEL, naming.LABEL_ROLE}
    assert labels[naming.LABEL_GROUP_ID] == GROUP
    assert all(LABEL_VALUE.match(v) for v in labels.values())
    assert labels[naming.LABEL_MODEL].startswith("organisation-with-a-long-name-some-very-long")


@pytest.mark.parametrize(
    ("instance_type", "spot", "metric"),
    [
        ("a3-highgpu-8g", False, "NVIDIA_H100_GPUS"),
        ("a3-highgpu-8g", True, "PREEMPTIBLE_NVIDIA_H100_GPUS"),
        ("a2-ultragpu-1g", False, "NVIDIA_A100_80GB_GPUS"),
        ("a2-highgpu-2g", False, "NVIDIA_A100_GPUS"),
        ("g2-standard-24", True, "PREEMPTIBLE_NVIDIA_L4_GPUS"),
        ("n1+4xT4", False, "NVIDIA_T4_GPUS"),
    ],
)
def test_gpu_quota_metric_of_a_machine_type(instance_type: str, spot: bool, metric: str) -> None:
    assert gpu_quota_metric(instance_type, spot) == metric


def test_gpu_quota_metric_of_an_unknown_type_is_a_provider_error() -> None:
    with pytest.raises(ProviderError):
        gpu_quota_metric("e2-standard-4")


def test_only_gpu_metrics_are_reported() -> None:
    rows = [("CPUS", 2400.0, 10.0), ("NVIDIA_L4_GPUS", 8.0, 2.0), ("PREEMPTIBLE_NVIDIA_H100_GPUS", 16.0, 0.0)]

    quotas = gpu_quotas("gcp:us-central1", rows)

    assert [(q.name, q.unit, q.limit, q.used, q.free) for q in quotas] == [
        ("NVIDIA_L4_GPUS", "gpus", 8.0, 2.0, 6.0),
        ("PREEMPTIBLE_NVIDIA_H100_GPUS", "gpus", 16.0, 0.0, 16.0),
    ]
