"""GCP as registered in `providers.provider.PROVIDERS`: its regions and the vendored catalog's
offerings (no google-cloud-compute here), and the factory of the live provider, imported only when built."""

from __future__ import annotations

from providers.gcp import offerings, regions
from providers.provider import ProviderDescription

DESCRIPTION = ProviderDescription.fixed(
    "gcp",
    regions=regions.regions,
    offerings=offerings.offerings,
    factory="providers.gcp.provider:GcpProvider.from_config",
)
