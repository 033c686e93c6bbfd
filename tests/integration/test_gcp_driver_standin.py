"""The GCP driver and provider against a local stand-in of the Compute Engine REST API.

The stand-in (gcp_compute_standin.py) serves the paths google-cloud-compute's REST transport
calls, with the behaviour of the API reference: resize only sets the target size, instances
appear CREATING then RUNNING, quota and stock-out failures show in lastAttempt.errors. Instance
templates are regional, as iac creates them; a MIG "created by Terraform" is inserted through the
same API, the way the google provider does.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from gcp_compute_standin import COMPUTE, ComputeStandIn, serving

from meridian.backoff import Backoff
from meridian.clock import ManualClock
from meridian.contracts import NODE_ID_PATTERN, NodeRole
from meridian.settings.providers import ProviderSettings
from providers.driver import GroupSpec, NodeGroupDriver
from providers.errors import AuthError, CapacityError, ProviderError, QuotaError
from providers.gcp import naming
from providers.gcp.driver import GcpDriver
from providers.gcp.offerings import offerings
from providers.gcp.provider import GcpProvider
from providers.provider import Provider, ProviderConfig, ProviderRegistry

PROJECT = "p"
REGION = "us-central1"
H100 = "a3-highgpu-8g"
FAST_POLL = Backoff(base_s=0.02, max_s=0.2, jitter=0.1)
GROUP_ID = "1b9d6bcd-bbfd-4b2d-9b5d-ab8dfbbd4bed"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[ComputeStandIn]:
    standin = ComputeStandIn(project=PROJECT)
    with serving(standin):
        yield standin


@pytest.fixture
def compute(server: ComputeStandIn) -> ComputeStandIn:
    """The stand-in, emptied, with an H100 quota of 64 GPUs (on-demand and Spot) in us-central1."""
    server.reset()
    server.boot_s = 0.15
    server.set_quota(REGION, "NVIDIA_H100_GPUS", 64)
    server.set_quota(REGION, "PREEMPTIBLE_NVIDIA_H100_GPUS", 64)
    return server


def make_settings(compute: ComputeStandIn, **overrides: float) -> ProviderSettings:
    values = {"call_timeout_s": 5.0, "operation_timeout_s": 20.0, **overrides}
    return ProviderSettings(gcp_project=PROJECT, gcp_endpoint_url=compute.url, **values)


@pytest.fixture
def driver(compute: ComputeStandIn) -> GcpDriver:
    return GcpDriver(make_settings(compute), poll=FAST_POLL)


def spec(instance_type: str = H100, spot: bool = False, group_id: str = GROUP_ID) -> GroupSpec:
    sku = next(o.sku for o in offerings() if o.instance_type == instance_type)
    return GroupSpec(
        group_id=group_id,
        model=MODEL,
        provider="gcp",
        region=f"gcp:{REGION}",
        instance_type=instance_type,
        sku=sku,
        spot=spot,
    )


def add_template(compute: ComputeStandIn, instance_type: str = H100, spot: bool = False) -> str:
    """The regional instance template iac would create for the machine type in REGION."""
    name = naming.instance_template_name("meridian", instance_type, spot)
    compute.add_template(name, instance_type, accelerator="NVIDIA_H100", gpus=8, spot=spot, region=REGION)
    return name


def mig_of(compute: ComputeStandIn, s: GroupSpec) -> str:
    return naming.mig_name("meridian", s.model, s.instance_type, s.spot)


def terraform_mig(
    compute: ComputeStandIn, s: GroupSpec, size: int, model: str = MODEL, template_url: str = ""
) -> str:
    """Insert the group's MIG as iac's google_compute_region_instance_group_manager does: under the
    group's name, one version on the regional template (or `template_url`), `size` VMs, the model's
    label and metadata, no group id."""
    name = mig_of(compute, s)
    template = naming.instance_template_name("meridian", s.instance_type, s.spot)
    template_url = template_url or f"projects/{PROJECT}/regions/{REGION}/instanceTemplates/{template}"
    body: dict[str, Any] = {
        "name": name,
        "baseInstanceName": naming.base_instance_name("meridian", model, s.region, s.instance_type, s.spot),
        "versions": [
            {
                "name": "primary",
                "instanceTemplate": template_url,
            }
        ],
        "targetSize": size,
        "distributionPolicy": {"targetShape": "BALANCED", "zones": [{"zone": f"zones/{REGION}-a"}]},
        "updatePolicy": {"type": "OPPORTUNISTIC", "instanceRedistributionType": "NONE"},
        "allInstancesConfig": {
            "properties": {
                "labels": {
                    naming.LABEL_MODEL: naming.label_value(model),
                    naming.LABEL_ROLE: naming.ROLE_NODE,
                },
                "metadata": {naming.METADATA_MODEL: model},
            }
        },
    }
    url = f"{compute.url}/compute/v1/projects/{PROJECT}/regions/{REGION}/instanceGroupManagers"
    httpx.post(url, json=body, timeout=5).raise_for_status()
    return name


def calls(compute: ComputeStandIn, method: str, suffix: str) -> int:
    return sum(1 for m, path, _ in compute.requests if m == method and path.endswith(suffix))


async def test_ensure_group_creates_the_mig_from_the_template_once(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    template = add_template(compute)
    s = spec()

    state = await driver.ensure_group(s)
    again = await driver.ensure_group(s, known_nodes=("ignored",))

    assert state.nodes == () and state.gpus_per_node == 8
    assert again == state
    assert calls(compute, "POST", "/instanceGroupManagers") == 1
    mig = compute.mig(REGION, mig_of(compute, s))
    assert mig.target_size == 0 and mig.template.name == template and mig.template.region == REGION
    # the regional template of the group's region, read with the regional API
    assert mig.body["instanceTemplate"] == f"projects/{PROJECT}/regions/{REGION}/instanceTemplates/{template}"
    assert calls(compute, "GET", f"/regions/{REGION}/instanceTemplates/{template}") >= 1
    assert calls(compute, "GET", f"/global/instanceTemplates/{template}") == 0
    zones = next(
        o.availability_zones for o in offerings() if o.instance_type == H100 and o.region == f"gcp:{REGION}"
    )
    assert set(mig.zones) == set(zones)
    assert mig.body["distributionPolicy"]["targetShape"] == "BALANCED"
    labels = mig.body["allInstancesConfig"]["properties"]["labels"]
    assert labels == naming.group_labels(MODEL, GROUP_ID)


async def test_resize_grows_to_created_instances_and_shrinks(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    add_template(compute)
    s = spec()
    await driver.ensure_group(s)

    grown = await driver.resize(s, 3)

    assert grown.size == 3 and grown.gpus_per_node == 8
    base = naming.base_instance_name("meridian", MODEL, s.region, s.instance_type, s.spot)
    assert all(n.startswith(base + "-") for n in grown.nodes)
    assert all(re.match(NODE_ID_PATTERN, n) for n in grown.nodes)
    # resize returns once every instance's VM exists, not when the resize operation is DONE
    instances = compute.mig(REGION, mig_of(compute, s)).instances.values()
    assert all(i.created_at is not None for i in instances)
    assert (await driver.list_nodes(s)).nodes == grown.nodes

    shrunk = await driver.resize(s, 1)

    assert shrunk.size == 1 and set(shrunk.nodes) <= set(grown.nodes)
    assert (await driver.list_nodes(s)).nodes == shrunk.nodes
    resizes = calls(compute, "POST", "/resize")
    assert (await driver.resize(s, 1)).nodes == shrunk.nodes
    assert calls(compute, "POST", "/resize") == resizes  # already at size: nothing to change


async def test_resize_does_not_wait_for_gpu_vms_to_boot(compute: ComputeStandIn, driver: GcpDriver) -> None:
    # A GPU VM boots for minutes; the node counts once its agent registers, and the
    # reconciler bounds every driver call, so resize returns when the VMs exist.
    add_template(compute)
    compute.boot_s = 30.0
    s = spec()
    started = time.monotonic()

    state = await driver.resize(s, 2)  # also creates the missing MIG

    assert state.size == 2
    assert time.monotonic() - started < 3
    assert (await driver.list_nodes(s)).nodes == state.nodes


async def test_resize_gives_up_after_the_operation_timeout(compute: ComputeStandIn) -> None:
    add_template(compute)
    compute.hold_creation = True
    # Ten minutes of the control plane's clock, not of the test's: the driver waits on it.
    clock = ManualClock()
    driver = GcpDriver(make_settings(compute, operation_timeout_s=600.0), poll=FAST_POLL, clock=clock)
    started = time.monotonic()

    resizing = asyncio.ensure_future(driver.resize(spec(), 1))
    while not resizing.done():
        if clock.sleepers:  # between two polls of the operation (each a real call, in a thread)
            clock.advance(60.0)
        await asyncio.sleep(0.005)
    with pytest.raises(ProviderError, match="timed out after 600s") as e:
        resizing.result()

    assert type(e.value) is ProviderError and e.value.retryable
    assert time.monotonic() - started < 10


async def test_terminate_deletes_the_named_instance(compute: ComputeStandIn, driver: GcpDriver) -> None:
    add_template(compute)
    s = spec()
    keep, drop = (await driver.resize(s, 2)).nodes

    state = await driver.terminate(s, drop)

    assert state.nodes == (keep,)
    assert compute.mig(REGION, mig_of(compute, s)).target_size == 1
    deletes = calls(compute, "POST", "/deleteInstances")
    assert (await driver.terminate(s, drop)).nodes == (keep,)
    assert calls(compute, "POST", "/deleteInstances") == deletes  # already gone: nothing sent


async def test_delete_group_is_idempotent(compute: ComputeStandIn, driver: GcpDriver) -> None:
    add_template(compute)
    s = spec()
    await driver.resize(s, 1)

    await driver.delete_group(s)
    await driver.delete_group(s)

    assert (REGION, mig_of(compute, s)) not in compute.migs
    assert (await driver.list_nodes(s)).nodes == ()
    assert (await driver.terminate(s, "gone-node")).nodes == ()


async def test_missing_template_is_a_clear_provider_error(compute: ComputeStandIn, driver: GcpDriver) -> None:
    # Templates are regional: one of that name in another region, or a global one, is not the group's.
    name = naming.instance_template_name("meridian", H100, False)
    compute.add_template(name, H100, accelerator="NVIDIA_H100", gpus=8, region="europe-west4")
    compute.add_template(name, H100, accelerator="NVIDIA_H100", gpus=8, region=None)

    with pytest.raises(ProviderError) as e:
        await driver.ensure_group(spec())

    message = str(e.value)
    assert type(e.value) is ProviderError and not e.value.retryable
    assert f"regional instance template {name} not found" in message
    assert f"project {PROJECT}, region {REGION}" in message and "Terraform" in message
    assert not compute.migs


async def test_a_mig_terraform_created_is_adopted_not_created_again(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    add_template(compute)
    s = spec()
    name = terraform_mig(compute, s, 2)
    inserts = calls(compute, "POST", "/instanceGroupManagers")

    adopted = await driver.ensure_group(s)
    at_size = await driver.resize(s, 2)  # iac's size already: nothing to send, the VMs are the group's

    assert adopted.size <= 2 and set(adopted.nodes) <= set(at_size.nodes) and at_size.size == 2
    assert calls(compute, "POST", "/resize") == 0
    grown = await driver.resize(s, 3)
    assert grown.size == 3 and set(at_size.nodes) < set(grown.nodes)
    assert calls(compute, "POST", "/instanceGroupManagers") == inserts  # no second MIG
    assert list(compute.migs) == [(REGION, name)]
    # the template is read once per MIG, not on every call
    reads = calls(compute, "GET", "/instanceTemplates/meridian-a3-highgpu-8g")
    assert (await driver.list_nodes(s)).nodes == grown.nodes
    assert calls(compute, "GET", "/instanceTemplates/meridian-a3-highgpu-8g") == reads

    await driver.delete_group(s)
    assert not compute.migs


async def test_a_mig_made_by_hand_on_a_global_template_of_the_machine_type_is_adopted(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    template = naming.instance_template_name("meridian", H100, False)
    compute.add_template(template, H100, accelerator="NVIDIA_H100", gpus=8, region=None)
    s = spec()
    global_url = f"{COMPUTE}/projects/{PROJECT}/global/instanceTemplates/{template}"
    name = terraform_mig(compute, s, 0, template_url=global_url)

    assert (await driver.resize(s, 1)).size == 1

    assert list(compute.migs) == [(REGION, name)]
    assert calls(compute, "GET", f"/global/instanceTemplates/{template}") == 1


async def test_prefill_and_decode_groups_are_migs_of_their_own_whose_vms_carry_their_role(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    add_template(compute)
    both = spec()
    prefill = replace(both, group_id=str(uuid.uuid4()), role=NodeRole.PREFILL)
    decode = replace(both, group_id=str(uuid.uuid4()), role=NodeRole.DECODE)
    nodes = {s.role: (await driver.resize(s, 2 if s is decode else 1)).nodes for s in (prefill, decode, both)}
    assert len({n for ns in nodes.values() for n in ns}) == 4
    # A co-located MIG is named and given metadata as before; each pool has its own MIG and names.
    plain = naming.mig_name("meridian", MODEL, H100, False)
    assert compute.mig(REGION, plain).body["allInstancesConfig"]["properties"]["metadata"] == {
        naming.METADATA_GROUP_ID: GROUP_ID, naming.METADATA_MODEL: MODEL,
    }
    for s in (prefill, decode):
        role = s.role.value
        mig = compute.mig(REGION, f"{plain}-{role}")
        props = mig.body["allInstancesConfig"]["properties"]
        # The metadata the node's boot reads into MERIDIAN_NODE_ROLE.
        assert props["metadata"][naming.METADATA_PD_ROLE] == role
        assert props["labels"][naming.LABEL_PD_ROLE] == role
        assert set(mig.instances) == set(nodes[s.role])
        base = naming.base_instance_name("meridian", MODEL, s.region, H100, False, role)
        assert all(n.startswith(base + "-") for n in nodes[s.role])
    # Each pool resizes alone.
    assert (await driver.resize(decode, 1)).size == 1
    assert (await driver.list_nodes(prefill)).nodes == nodes[NodeRole.PREFILL]


async def test_a_mig_of_another_role_under_the_name_is_refused(compute: ComputeStandIn, driver: GcpDriver) -> None:
    add_template(compute)
    decode = replace(spec(), role=NodeRole.DECODE)
    await driver.ensure_group(decode)
    name = naming.mig_name("meridian", MODEL, H100, False, "decode")
    compute.mig(REGION, name).body["allInstancesConfig"]["properties"]["metadata"][naming.METADATA_PD_ROLE] = "prefill"
    with pytest.raises(ProviderError, match=f"MIG {name} runs prefill nodes .metadata meridian-pd-role., not decode"):
        await driver.resize(decode, 1)
    assert compute.mig(REGION, name).target_size == 0


async def test_a_mig_of_another_model_under_the_name_is_refused(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    add_template(compute)
    s = spec()
    name = terraform_mig(compute, s, 1, model="someone/elses-model")
    ops: list[Callable[[], Awaitable[object]]] = [
        lambda: driver.ensure_group(s),
        lambda: driver.resize(s, 3),
        lambda: driver.list_nodes(s),
        lambda: driver.terminate(s, "any-node"),
        lambda: driver.delete_group(s),
    ]

    for op in ops:
        with pytest.raises(
            ProviderError, match=f"MIG {name} is labelled meridian-model='someone-elses-model'"
        ) as e:
            await op()
        assert not e.value.retryable and "rename or delete it" in str(e.value)

    assert compute.mig(REGION, name).target_size == 1  # untouched
    assert calls(compute, "POST", "/resize") == calls(compute, "DELETE", name) == 0


async def test_a_mig_of_another_machine_type_under_the_name_is_refused(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    other = naming.instance_template_name("meridian", "g2-standard-8", False)
    compute.add_template(other, "g2-standard-8", accelerator="NVIDIA_L4", gpus=1, region=REGION)
    add_template(compute)
    s = spec()
    name = terraform_mig(
        compute, s, 0, template_url=f"projects/{PROJECT}/regions/{REGION}/instanceTemplates/{other}"
    )

    with pytest.raises(ProviderError, match=f"makes g2-standard-8 VMs, not {H100}") as e:
        await driver.resize(s, 1)

    assert not e.value.retryable and other in str(e.value)
    with pytest.raises(ProviderError, match="g2-standard-8"):
        await driver.delete_group(s)
    assert compute.mig(REGION, name).target_size == 0


async def test_quota_exceeded_is_a_quota_error_without_waiting_for_the_timeout(
    compute: ComputeStandIn,
) -> None:
    add_template(compute)
    compute.set_quota(REGION, "NVIDIA_H100_GPUS", 16)  # two 8-GPU instances
    driver = GcpDriver(make_settings(compute, operation_timeout_s=60.0), poll=FAST_POLL)
    started = time.monotonic()

    with pytest.raises(QuotaError) as e:
        await driver.resize(spec(), 3)

    assert time.monotonic() - started < 5
    assert "NVIDIA_H100_GPUS" in str(e.value) and REGION in str(e.value) and H100 in str(e.value)
    # the two that fit run; the group holds them
    assert (await driver.list_nodes(spec())).size == 2


async def test_stockout_is_a_capacity_error(compute: ComputeStandIn, driver: GcpDriver) -> None:
    add_template(compute)
    compute.stockout(REGION)

    with pytest.raises(CapacityError) as e:
        await driver.resize(spec(), 1)

    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in str(e.value) and H100 in str(e.value)


@pytest.mark.parametrize("code", [401, 403])
async def test_auth_failure_is_an_auth_error(compute: ComputeStandIn, driver: GcpDriver, code: int) -> None:
    add_template(compute)
    compute.auth_failure(code)

    with pytest.raises(AuthError) as e:
        await driver.ensure_group(spec())

    assert not e.value.retryable
    assert f"project {PROJECT}" in str(e.value)


async def test_preemption_notices_report_preempted_spot_vms(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    add_template(compute, spot=True)
    add_template(compute, spot=False)
    spot, on_demand = spec(spot=True), spec(group_id="2c9d6bcd-0000-4b2d-9b5d-ab8dfbbd4bed")
    preempted, old, _ = (await driver.resize(spot, 3)).nodes
    await driver.resize(on_demand, 1)
    assert await driver.preemption_notices(spot) == []

    compute.preempt(old, at=datetime.now(UTC) - timedelta(minutes=10))
    before = datetime.now(UTC)
    compute.preempt(preempted)
    notices = await driver.preemption_notices(spot)

    assert [n.node for n in notices] == [preempted]
    assert before + timedelta(seconds=29) <= notices[0].deadline <= datetime.now(UTC) + timedelta(seconds=30)
    assert "preempt" in notices[0].reason.lower()
    assert await driver.preemption_notices(on_demand) == []


async def test_unknown_machine_type_is_refused_before_calling_gcp(
    compute: ComputeStandIn, driver: GcpDriver
) -> None:
    bad = GroupSpec(
        group_id=GROUP_ID,
        model=MODEL,
        provider="gcp",
        region=f"gcp:{REGION}",
        instance_type="z9-giantgpu-64g",
        sku="H100-80GB-SXM",
    )

    with pytest.raises(ProviderError, match="z9-giantgpu-64g"):
        await driver.ensure_group(bad)

    assert compute.requests == []


async def test_quotas_report_the_regions_gpu_quotas(compute: ComputeStandIn) -> None:
    add_template(compute)
    compute.set_quota(REGION, "NVIDIA_L4_GPUS", 8)
    compute.set_quota(REGION, "CPUS", 2400)
    provider = GcpProvider(make_settings(compute))
    await GcpDriver(make_settings(compute), poll=FAST_POLL).resize(spec(), 1)

    quotas = {q.name: q for q in await provider.quotas(f"gcp:{REGION}")}

    assert set(quotas) == {"NVIDIA_H100_GPUS", "PREEMPTIBLE_NVIDIA_H100_GPUS", "NVIDIA_L4_GPUS"}
    h100 = quotas["NVIDIA_H100_GPUS"]
    assert (h100.region, h100.unit, h100.limit, h100.used, h100.free) == (f"gcp:{REGION}", "gpus", 64, 8, 56)
    assert quotas["NVIDIA_L4_GPUS"].used == 0


async def test_registry_builds_the_gcp_provider_by_name(compute: ComputeStandIn) -> None:
    provider = ProviderRegistry().create(
        "gcp", ProviderConfig(ProviderSettings(gcp_project=PROJECT, gcp_endpoint_url=compute.url))
    )

    assert isinstance(provider, GcpProvider) and isinstance(provider, Provider)
    assert provider.name == "gcp"
    assert isinstance(provider.driver(), NodeGroupDriver) and provider.driver().provider == "gcp"
    assert f"gcp:{REGION}" in {r.name for r in provider.regions()}
    assert any(o.instance_type == H100 for o in provider.offerings())
    assert {q.name for q in await provider.quotas(REGION)} >= {"NVIDIA_H100_GPUS"}
