"""The on-prem node-group driver: groups are allocations of the inventory's hosts."""

from __future__ import annotations

import pytest

from meridian.contracts import NodeRole
from meridian.registry import UnknownName
from providers.driver import DriverRegistry, GroupSpec, NodeGroupDriver
from providers.errors import CapacityError, ProviderError
from providers.onprem.driver import OnPremDriver
from providers.onprem.inventory import Inventory

INVENTORY = Inventory.model_validate({"sites": [{
    "name": "lab-1", "latitude": 50.1, "longitude": 8.7, "zones": ["eu"],
    "hosts": [
        {"instance_type": "l4-box", "sku": "L4-24GB", "gpu_count": 1, "count": 3, "vcpus": 8, "memory_gib": 32},
        {"instance_type": "h100-box", "sku": "H100-80GB-SXM", "gpu_count": 8, "count": 1, "vcpus": 96,
         "memory_gib": 1024},
    ],
}]})


def spec(group_id: str, instance_type: str = "l4-box", sku: str = "L4-24GB", **fields: object) -> GroupSpec:
    values: dict[str, object] = {
        "group_id": group_id, "model": "m", "provider": "onprem", "region": "onprem:lab-1",
        "instance_type": instance_type, "sku": sku, **fields,
    }
    return GroupSpec(**values)  # type: ignore[arg-type]


async def test_groups_take_free_hosts_and_cannot_exceed_the_site() -> None:
    driver = OnPremDriver(INVENTORY)
    assert isinstance(driver, NodeGroupDriver)
    a, b = spec("a"), spec("b")
    assert (await driver.ensure_group(a)).nodes == ()
    state = await driver.resize(a, 2)
    assert state.nodes == ("lab-1-l4-box-1", "lab-1-l4-box-2")
    assert state.gpus_per_node == 1
    # Idempotent.
    assert (await driver.resize(a, 2)).nodes == state.nodes
    assert (await driver.ensure_group(a)).nodes == state.nodes
    # Another group gets what is left, and no more.
    assert (await driver.resize(b, 1)).nodes == ("lab-1-l4-box-3",)
    with pytest.raises(CapacityError, match="0 free l4-box host"):
        await driver.resize(b, 2)
    assert driver.free_hosts("onprem:lab-1", "l4-box") == 0

    # A named node goes back to the site; shrinking gives back the newest first.
    assert (await driver.terminate(a, "lab-1-l4-box-1")).nodes == ("lab-1-l4-box-2",)
    assert (await driver.terminate(a, "lab-1-l4-box-1")).nodes == ("lab-1-l4-box-2",)
    assert (await driver.resize(b, 2)).nodes == ("lab-1-l4-box-3", "lab-1-l4-box-1")
    assert (await driver.resize(b, 1)).nodes == ("lab-1-l4-box-3",)
    await driver.delete_group(b)
    assert (await driver.list_nodes(b)).nodes == ()
    assert driver.free_hosts("onprem:lab-1", "l4-box") == 2


async def test_a_new_driver_adopts_the_hosts_the_control_plane_recorded() -> None:
    driver = OnPremDriver(INVENTORY)
    a = spec("a")
    assert (await driver.ensure_group(a, ["lab-1-l4-box-3"])).nodes == ("lab-1-l4-box-3",)
    assert (await driver.resize(a, 2)).nodes == ("lab-1-l4-box-3", "lab-1-l4-box-1")
    with pytest.raises(ProviderError, match="already allocated"):
        await driver.ensure_group(spec("b"), ["lab-1-l4-box-1"])
    with pytest.raises(ProviderError, match="not a l4-box host"):
        await driver.ensure_group(spec("c"), ["lab-1-h100-box-1"])


async def test_groups_the_inventory_cannot_hold_are_refused() -> None:
    driver = OnPremDriver(INVENTORY)
    with pytest.raises(CapacityError, match="no hosts of type"):
        await driver.ensure_group(spec("x", instance_type="a100-box"))
    with pytest.raises(CapacityError):
        await driver.ensure_group(spec("x", region="onprem:elsewhere"))
    with pytest.raises(ProviderError, match="carry H100-80GB-SXM"):
        await driver.ensure_group(spec("x", instance_type="h100-box", sku="L4-24GB"))
    with pytest.raises(ProviderError, match="spot"):
        await driver.ensure_group(spec("x", spot=True))
    with pytest.raises(ProviderError, match="not on-prem"):
        await driver.ensure_group(spec("x", provider="aws"))


def test_the_registry_finds_drivers_by_provider() -> None:
    registry = DriverRegistry()
    driver = OnPremDriver(INVENTORY)
    registry.register_driver(driver)
    assert registry.get_driver("onprem") is driver
    assert registry.providers() == ["onprem"]
    with pytest.raises(UnknownName, match="unknown node-group driver 'aws'; known: onprem"):
        registry.get_driver("aws")


async def test_a_pools_hosts_run_in_its_role_and_co_located_hosts_as_before() -> None:
    driver = OnPremDriver(INVENTORY)
    prefill, decode, both = spec("p", role=NodeRole.PREFILL), spec("d", role=NodeRole.DECODE), spec("b")
    (p_host,) = (await driver.resize(prefill, 1)).nodes
    (d_host,) = (await driver.resize(decode, 1)).nodes
    (b_host,) = (await driver.resize(both, 1)).nodes
    assert driver.host_env(p_host) == {
        "MERIDIAN_NODE_MODEL_NAME": "m", "MERIDIAN_NODE_REGION": "onprem:lab-1", "MERIDIAN_NODE_ROLE": "prefill",
    }
    assert driver.host_env(d_host)["MERIDIAN_NODE_ROLE"] == "decode"
    assert driver.host_env(b_host) == {"MERIDIAN_NODE_MODEL_NAME": "m", "MERIDIAN_NODE_REGION": "onprem:lab-1"}
    # A host given back runs nothing of the group's; a group keeps its role.
    await driver.terminate(prefill, p_host)
    assert driver.host_env(p_host) == {}
    with pytest.raises(ProviderError, match="runs prefill nodes, not decode"):
        await driver.resize(spec("p", role=NodeRole.DECODE), 1)
