"""One provider behind one small protocol: what it sells, where, how much of it we may use,
and the driver that grows and shrinks its node groups.

Providers are registered by name (`register_provider`); the built-in ones are imported
only when asked for, so a control plane that runs on-prem only never imports boto3 or
google-cloud-compute (each cloud's SDK is imported inside its own package only).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from meridian.contracts import RegionInfo
from meridian.settings import ProviderSettings
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


ProviderFactory = Callable[[ProviderConfig], Provider]

# Built-in providers by name, as "module:attribute" so that an SDK is imported only when used.
_BUILTIN = {
    "aws": "providers.aws.provider:AwsProvider.from_config",
    "gcp": "providers.gcp.provider:GcpProvider.from_config",
    "onprem": "providers.onprem.provider:OnPremProvider.from_config",
}


class UnknownProviderError(LookupError):
    """No provider is registered under that name."""


class ProviderRegistry:
    """Provider factories by name; the built-ins are there from the start."""

    def __init__(self) -> None:
        self._factories: dict[str, ProviderFactory | str] = dict(_BUILTIN)

    def register_provider(self, name: str, factory: ProviderFactory) -> None:
        """Make `factory` the provider called `name` (replacing a built-in of that name)."""
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def create(self, name: str, config: ProviderConfig) -> Provider:
        """A new provider object; UnknownProviderError when `name` is not registered."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise UnknownProviderError(f"unknown provider {name!r}; known: {', '.join(self.names())}") from None
        if isinstance(factory, str):
            factory = _load(factory)
        return factory(config)


def _load(target: str) -> ProviderFactory:
    module_name, _, attr_path = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj  # type: ignore[return-value]
