"""On-prem as registered in `providers.provider.PROVIDERS`: the inventory's sites as regions,
their host classes as offerings, the hosts racked as the limit of each, and the factory of the
live provider (the allocation driver)."""

from __future__ import annotations

from providers.onprem import offerings, regions
from providers.provider import ProviderDescription

DESCRIPTION = ProviderDescription(
    "onprem",
    regions=regions.regions,
    offerings=offerings.offerings,
    factory="providers.onprem.provider:OnPremProvider.from_config",
    host_limits=offerings.host_capacity,
)
