"""One provider behind one small protocol: what it sells, where, how much of it we may use,
and the driver that grows and shrinks its node groups.

A provider is registered once, by name, as a `ProviderDescription`: its regions and its
catalog offerings (read from data alone, with no SDK and no credentials, so the catalog, the
placement solver and the routing table can list it anywhere) and the factory of the live
`Provider` (SDK clients, quotas, the node-group driver). The catalog and the region list
iterate the registered descriptions, so one `PROVIDERS.register_provider(...)` call is all
a fourth provider needs to show up in `meridian catalog gpus` and in the routing table (and,
with its driver enabled in MERIDIAN_PROVIDER_ENABLED, in placement plans).

Built-ins are `"module:attr"` strings (`meridian.registry.Registry`), and each built-in's
factory is one too: listing the catalog imports only the vendored rows, and a control plane
that runs on-prem only never imports boto3 or google-cloud-compute (each cloud's SDK is
imported inside its own package only). An unknown name is `meridian.registry.UnknownName`,
which lists the registered providers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, cast, runtime_checkable

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import RegionInfo
from meridian.registry import Registry, load_target
from meridian.settings.providers import ProviderSettings
from providers.driver import NodeGroupDriver
from providers.offerings import Offering
from providers.onprem.inventory import Inventory


@dataclass(frozen=True, slots=True)
class Quota:
    """One of the account's limits in a region, in the unit the provider counts it.

    AWS counts vCPUs per instance family ("Running On-Demand P instances"), GCP counts GPUs
    per model ("NVIDIA_H100_GPUS"); an on-prem site's limit is its racked hosts.
    """

    region: str
    name: str
    unit: Literal["vcpus", "gpus", "instances"]
    limit: float
    used: float | None = None  # None when the provider does not report usage

    @property
    def free(self) -> float | None:
        return None if self.used is None else max(0.0, self.limit - self.used)


@runtime_checkable
class Provider(Protocol):
    """A cloud or on-prem estate as the control plane sees it."""

    name: str

    def regions(self) -> list[RegionInfo]:
        """Regions (`<provider>:<location>`) with their residency zones."""
        ...

    def offerings(self) -> list[Offering]:
        """Instance types per region as canonical SKU × count, with prices (from the catalog)."""
        ...

    async def quotas(self, region: str) -> list[Quota]:
        """The account's GPU-relevant limits in `region` (and what is used, where known)."""
        ...

    def driver(self) -> NodeGroupDriver:
        """The node-group driver (one per provider object; it may hold pooled clients)."""
        ...


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """What a provider is built from: the settings, and the on-prem inventory the control
    plane parsed once at start-up (None: the built-in default sites)."""

    settings: ProviderSettings
    onprem_inventory: Inventory | None = None
    # The control plane's one clock: a driver's waits and deadlines run on it.
    clock: Clock = SYSTEM_CLOCK


ProviderFactory = Callable[[ProviderConfig], Provider]


def _no_host_limits(sites: Inventory) -> dict[tuple[str, str], int]:
    return {}


@dataclass(frozen=True, slots=True)
class ProviderDescription:
    """A provider as registered: what it sells and where, and how to build the live provider.

    `regions`, `offerings` and `host_limits` are read from data (vendored catalog rows, a
    site inventory) without an SDK or credentials. Each takes `sites`, the parsed on-prem
    inventory of this control plane: the one input a provider's listing may depend on that
    varies between installations (a cloud's listing ignores it). `host_limits` is the most
    instances of an offering there are, by (region, instance type), for providers of finite
    sites; a cloud has none (its quotas are enforced when it provisions). `factory` builds
    the live provider; a `"module:attr"` string is imported only then, so that listing a
    provider never loads its SDK.
    """

    name: str
    regions: Callable[[Inventory], list[RegionInfo]]
    offerings: Callable[[Inventory], list[Offering]]
    factory: ProviderFactory | str
    host_limits: Callable[[Inventory], dict[tuple[str, str], int]] = _no_host_limits

    @classmethod
    def fixed(
        cls,
        name: str,
        *,
        regions: Callable[[], list[RegionInfo]],
        offerings: Callable[[], list[Offering]],
        factory: ProviderFactory | str,
    ) -> ProviderDescription:
        """A provider whose listing is the same in every installation (a cloud's vendored rows)."""
        return cls(name, regions=lambda sites: regions(), offerings=lambda sites: offerings(), factory=factory)

    def create(self, config: ProviderConfig) -> Provider:
        """A new live provider object (imports the factory's module if it is a string)."""
        factory = self.factory
        if isinstance(factory, str):
            factory = cast(ProviderFactory, load_target(factory))
        return factory(config)


# Built-in providers by name: light modules of vendored data (no SDK) that name their factories.
_BUILTIN = {
    "aws": "providers.aws.description:DESCRIPTION",
    "gcp": "providers.gcp.description:DESCRIPTION",
    "onprem": "providers.onprem.description:DESCRIPTION",
}


class ProviderRegistry(Registry[ProviderDescription]):
    """Provider descriptions by name; the built-ins are there from the start.

    `PROVIDERS` below is the process-wide one that the catalog, the region list and the
    control plane read; a test or an app that needs its own takes `PROVIDERS.copy()`.
    """

    def __init__(self) -> None:
        super().__init__("provider", _BUILTIN)

    def register_provider(self, description: ProviderDescription) -> ProviderDescription:
        """Make `description` the provider called `description.name` (replacing a built-in of that name)."""
        return self.register(description.name, description)

    def descriptions(self) -> list[ProviderDescription]:
        """Every registered provider, in name order (built-ins imported now)."""
        return [self.get(name) for name in self.names()]

    def create(self, name: str, config: ProviderConfig) -> Provider:
        """A new provider object; UnknownName (listing the known providers) when `name` is not registered."""
        return self.get(name).create(config)

    def copy(self) -> ProviderRegistry:
        """A registry of its own with the same providers."""
        other = ProviderRegistry()
        for name in self.names():
            other.register(name, self.get(name))
        return other


PROVIDERS = ProviderRegistry()
