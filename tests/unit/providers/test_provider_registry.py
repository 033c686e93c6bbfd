"""The provider registry: built-ins by name, a registered description's regions, offerings and
host limits in the catalog and the region list, one UnknownName for a provider not registered.
(A fourth provider end to end, through the CLI and a control plane: tests/unit/control_plane/
test_cp_fourth_provider.py.)"""

from __future__ import annotations

import pytest

from meridian.contracts import RegionInfo
from meridian.registry import UnknownName
from meridian.settings.providers import ProviderSettings
from providers.catalog import load_catalog
from providers.offerings import Offering
from providers.onprem.inventory import Inventory
from providers.provider import PROVIDERS, Provider, ProviderConfig, ProviderDescription, ProviderRegistry
from providers.regions import region_catalog

REGION = RegionInfo(name="colo:lab-9", provider="colo", location="lab-9", zones=["eu"], latitude=50.0, longitude=8.0)
OFFERING = Offering(provider="colo", region="colo:lab-9", instance_type="l4-pair", sku="L4-24GB", gpu_count=2,
                    vcpus=16, memory_gib=64, price_per_hour=1.5, spot_price_per_hour=None)


def _not_built(config: ProviderConfig) -> Provider:
    raise AssertionError("listing a provider must not build it")


def colo() -> ProviderDescription:
    """A provider of finite sites, read from the same inventory argument the on-prem one gets."""

    def host_limits(sites: Inventory) -> dict[tuple[str, str], int]:
        return {(REGION.name, OFFERING.instance_type): 3}

    return ProviderDescription(
        "colo", regions=lambda sites: [REGION], offerings=lambda sites: [OFFERING],
        factory=_not_built, host_limits=host_limits,
    )


def test_built_ins_are_there_and_an_unknown_name_lists_them() -> None:
    registry = ProviderRegistry()
    assert registry.names() == ["aws", "gcp", "onprem"]
    with pytest.raises(UnknownName, match="unknown provider 'azure'; known: aws, gcp, onprem") as caught:
        registry.create("azure", ProviderConfig(ProviderSettings()))
    assert caught.value.kind == "provider" and caught.value.known == ["aws", "gcp", "onprem"]


def test_a_registered_provider_is_in_the_catalog_and_the_regions_of_its_registry_alone() -> None:
    registry = PROVIDERS.copy()
    registry.register_provider(colo())
    assert "colo" in registry and "colo" not in PROVIDERS

    catalog = load_catalog(providers=registry)
    assert catalog.providers == ("aws", "colo", "gcp", "onprem")
    assert catalog.for_region(REGION.name) == [OFFERING]
    assert catalog.host_limits[(REGION.name, "l4-pair")] == 3
    assert catalog.gpu_capacity(REGION.name, "L4-24GB") == 6
    assert region_catalog(providers=registry)[REGION.name] == REGION

    assert "colo" not in load_catalog().providers
    assert REGION.name not in region_catalog()
