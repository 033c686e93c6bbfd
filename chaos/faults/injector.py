"""The Injector protocol and the registry of injectors by fault kind."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from chaos.drill import Fault, FaultKind
from chaos.history import History
from localfabric import FabricSpec

if TYPE_CHECKING:
    from chaos.environment import DrillEnvironment


class NotRunnable(ValueError):
    """The drill's fault has no injector for this environment (the message says why)."""


class Injector(Protocol):
    """Injects one fault at its start and heals it at its end.

    `observe` reports the invariants the injector can see (chaos.drill.Invariant names),
    called once after the load has ended, with the run's history.
    """

    async def inject(self) -> None: ...

    async def heal(self) -> None: ...

    async def observe(self, history: History) -> Mapping[str, bool]: ...


InjectorFactory = Callable[[Fault, "DrillEnvironment"], Injector]


class PreparesFabric(Protocol):
    """Optional hooks of an injector class: `prepare(fault, spec)` adjusts the FabricSpec
    before it starts (a deployment, a setting); `unavailable()` says why this machine cannot
    inject the fault (no root for a mount), None when it can."""

    @staticmethod
    def prepare(fault: Fault, spec: FabricSpec) -> None: ...

    @staticmethod
    def unavailable() -> str | None: ...

_REGISTRY: dict[str, InjectorFactory] = {}


def register(*kinds: FaultKind) -> Callable[[InjectorFactory], InjectorFactory]:
    """Class decorator: the injector for these fault kinds."""

    def add(factory: InjectorFactory) -> InjectorFactory:
        for kind in kinds:
            _REGISTRY[kind] = factory
        return factory

    return add


def _load_builtins() -> None:
    # Importing the modules registers their injectors.
    from chaos.faults import burst, netns, network, process, weights  # noqa: F401


def unavailable(kind: str) -> str | None:
    """Why this machine cannot inject `kind` (its injector's own check); None when it can."""
    _load_builtins()
    check = getattr(_REGISTRY.get(kind), "unavailable", None)
    return check() if check is not None else None


def supported_kinds() -> list[str]:
    """Fault kinds the local runner can inject."""
    _load_builtins()
    return sorted(_REGISTRY)


def prepare_fabric(fault: Fault, spec: FabricSpec) -> None:
    """Let the fault's injector adjust the fabric it will run against (before it starts)."""
    _load_builtins()
    prepare = getattr(_REGISTRY.get(fault.kind), "prepare", None)
    if prepare is not None:
        prepare(fault, spec)


def create_injector(fault: Fault, env: DrillEnvironment) -> Injector:
    """The injector for `fault`; NotRunnable when there is none yet."""
    _load_builtins()
    factory = _REGISTRY.get(fault.kind)
    if factory is None:
        raise NotRunnable(
            f"no local injector for {fault.kind!r} yet (runnable kinds: {', '.join(sorted(_REGISTRY))})"
        )
    return factory(fault, env)
