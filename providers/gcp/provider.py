"""The GCP provider: its regions, the vendored catalog's offerings, GPU quotas and the MIG driver."""

from __future__ import annotations

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import RegionInfo
from meridian.settings.providers import ProviderSettings
from providers.driver import NodeGroupDriver
from providers.gcp import offerings as gcp_offerings
from providers.gcp import regions as gcp_regions
from providers.gcp.clients import LazyClients
from providers.gcp.driver import PROVIDER, GcpDriver, permanent_error
from providers.gcp.quotas import region_quotas
from providers.offerings import Offering
from providers.provider import ProviderConfig, Quota


class GcpProvider:
    """Compute Engine in `settings.gcp_project`; clients are built on first use (providers.gcp.clients)."""

    name = PROVIDER

    def __init__(self, settings: ProviderSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        self._settings = settings
        self._clients = LazyClients(settings)
        # Parsed once, for the driver and for offerings() alike.
        self._offerings = gcp_offerings.offerings()
        self._driver = GcpDriver(settings, clients=self._clients, offerings=self._offerings, clock=clock)

    @classmethod
    def from_config(cls, config: ProviderConfig) -> GcpProvider:
        return cls(config.settings, config.clock)

    def regions(self) -> list[RegionInfo]:
        return gcp_regions.regions()

    def offerings(self) -> list[Offering]:
        return list(self._offerings)

    async def quotas(self, region: str) -> list[Quota]:
        """GPU quotas (NVIDIA_*_GPUS, PREEMPTIBLE_NVIDIA_*_GPUS, ...) of the project in `region`."""
        if not self._settings.gcp_project:
            raise permanent_error("no GCP project configured: set MERIDIAN_PROVIDER_GCP_PROJECT")
        return await region_quotas(
            self._clients, self._settings.gcp_project, region, self._settings.call_timeout_s
        )

    def driver(self) -> NodeGroupDriver:
        return self._driver
