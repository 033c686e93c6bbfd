"""AWS as registered in `providers.provider.PROVIDERS`: its regions and the vendored catalog's
offerings (no boto3 here), and the factory of the live provider, imported only when built."""

from __future__ import annotations

from providers.aws import offerings, regions
from providers.provider import ProviderDescription

DESCRIPTION = ProviderDescription.fixed(
    "aws",
    regions=regions.regions,
    offerings=offerings.offerings,
    factory="providers.aws.provider:AwsProvider.from_config",
)
