"""The AWS provider: its regions, the catalog's GPU offerings, Service Quotas, and the Auto Scaling driver."""

from __future__ import annotations

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import RegionInfo
from meridian.settings.providers import ProviderSettings
from providers.aws import offerings as aws_offerings
from providers.aws import regions as aws_regions
from providers.aws.clients import AwsClients
from providers.aws.driver import AwsDriver
from providers.aws.errors import PROVIDER
from providers.aws.quotas import AwsQuotas
from providers.driver import NodeGroupDriver
from providers.offerings import Offering
from providers.provider import ProviderConfig, Quota


class AwsProvider:
    """AWS as the control plane sees it; one set of boto3 clients serves the driver and quotas."""

    name = PROVIDER

    def __init__(self, settings: ProviderSettings | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self._settings = settings or ProviderSettings()
        self._offerings = aws_offerings.offerings()
        self._clients = AwsClients(self._settings)
        self._driver = AwsDriver(clients=self._clients, offerings=self._offerings, clock=clock)
        self._quotas = AwsQuotas(self._clients, self._offerings)

    @classmethod
    def from_config(cls, config: ProviderConfig) -> AwsProvider:
        return cls(config.settings, config.clock)

    def regions(self) -> list[RegionInfo]:
        return aws_regions.regions()

    def offerings(self) -> list[Offering]:
        return list(self._offerings)

    async def quotas(self, region: str) -> list[Quota]:
        """Limits and vCPUs in use of the on-demand and spot P, G and VT quotas (providers.aws.quotas)."""
        return await self._quotas.quotas(region)

    def driver(self) -> NodeGroupDriver:
        return self._driver

    def close(self) -> None:
        """Close the boto3 clients' connections."""
        self._clients.close()
