"""How the GCP driver tells a MIG it may adopt from one under the group's name that is not its own."""

from __future__ import annotations

import pytest
from google.cloud import compute_v1

from providers.gcp import naming
from providers.gcp.migs import label_mismatch, template_mismatch, template_urls


def template(
    machine_type: str, *, spot: bool = False, gpus: tuple[str, int] | None = None
) -> compute_v1.InstanceTemplate:
    """A template as iac writes it (machine type, market, attached GPUs) and the API returns it."""
    props = compute_v1.InstanceProperties(
        machine_type=machine_type,
        scheduling=compute_v1.Scheduling(provisioning_model="SPOT" if spot else "STANDARD", preemptible=spot),
    )
    if gpus is not None:
        props.guest_accelerators = [
            compute_v1.AcceleratorConfig(
                accelerator_type=f"projects/p/zones/us-central1-a/acceleratorTypes/{gpus[0]}",
                accelerator_count=gpus[1],
            )
        ]
    return compute_v1.InstanceTemplate(name="t", properties=props)


def test_a_template_of_the_machine_type_and_market_matches() -> None:
    assert template_mismatch(template("a3-highgpu-8g"), "a3-highgpu-8g", spot=False) is None
    assert template_mismatch(template("a3-highgpu-8g", spot=True), "a3-highgpu-8g", spot=True) is None
    assert (
        template_mismatch(template("g2-standard-8"), "a3-highgpu-8g", False)
        == "makes g2-standard-8 VMs, not a3-highgpu-8g"
    )
    assert (
        template_mismatch(template("a3-highgpu-8g"), "a3-highgpu-8g", True) == "makes on-demand VMs, not Spot"
    )


@pytest.mark.parametrize(
    ("machine_type", "gpus", "matches"),
    [
        ("n1-standard-32", ("nvidia-tesla-t4", 4), True),  # iac's host for n1+4xT4
        ("n1-highmem-16", ("nvidia-tesla-t4", 4), True),  # any n1 host carrying the GPUs
        ("n1-standard-32", ("nvidia-tesla-t4", 2), False),
        ("n1-standard-32", ("nvidia-tesla-v100", 4), False),
        ("n2-standard-32", ("nvidia-tesla-t4", 4), False),
        ("n1-standard-32", None, False),
    ],
)
def test_an_attached_gpu_offering_is_an_n1_host_with_those_gpus(
    machine_type: str, gpus: tuple[str, int] | None, matches: bool
) -> None:
    problem = template_mismatch(template(machine_type, gpus=gpus), "n1+4xT4", spot=False)

    assert (problem is None) == matches
    if not matches:
        assert "not n1+4xT4" in str(problem)


def test_a_mig_is_labelled_for_its_model() -> None:
    model = "meta-llama/Llama-3.1-8B-Instruct"

    def mig(
        labels: dict[str, str], metadata: dict[str, str] | None = None
    ) -> compute_v1.InstanceGroupManager:
        props = compute_v1.InstancePropertiesPatch(labels=labels, metadata=metadata or {})
        return compute_v1.InstanceGroupManager(
            all_instances_config=compute_v1.InstanceGroupManagerAllInstancesConfig(properties=props)
        )

    assert label_mismatch(mig({naming.LABEL_MODEL: naming.label_value(model)}), model) is None
    assert (
        label_mismatch(mig({}), model)
        == "has no meridian-model label (expected 'meta-llama-llama-3-1-8b-instruct')"
    )
    assert "not 'meta-llama-llama-3-1-8b-instruct'" in str(
        label_mismatch(mig({naming.LABEL_MODEL: "other"}), model)
    )
    # The label is lowercased; the exact name in the metadata tells models apart that it cannot.
    lower = mig({naming.LABEL_MODEL: naming.label_value(model)}, {naming.METADATA_MODEL: model.lower()})
    assert (
        label_mismatch(lower, model) == f"serves {model.lower()!r} (metadata meridian-model), not {model!r}"
    )


def test_the_templates_of_a_mig_are_its_versions_and_its_own() -> None:
    regional = "projects/p/regions/us-central1/instanceTemplates/meridian-a3-highgpu-8g"
    by_terraform = compute_v1.InstanceGroupManager(
        versions=[compute_v1.InstanceGroupManagerVersion(name="primary", instance_template=regional)]
    )
    by_driver = compute_v1.InstanceGroupManager(instance_template=regional)

    assert template_urls(by_terraform) == template_urls(by_driver) == [regional]
