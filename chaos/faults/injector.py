"""The Injector protocol and the registry of injectors by fault kind.

`INJECTORS` is a `meridian.registry.Registry` of injector factories (in practice classes)
by fault kind. The built-ins are `"module:Class"` strings, imported the first time their
kind is looked up, so that this module imports none of the fault modules: they import the
environment they act on, which the schedule that drives them also imports, and an import
of them from here would close a cycle. Anything may register an injector for a new kind
(or replace a built-in) with `INJECTORS.register(kind, factory)` before a run.

An injector class may carry two optional static hooks (`PreparesFabric`): `prepare` adjusts
the FabricSpec before the fabric starts, and `unavailable` says why this machine cannot
inject its fault.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from chaos.drill import FAULTS, Fault
from chaos.environment import DrillEnvironment
from chaos.history import History
from localfabric import FabricSpec
from meridian.registry import Registry, UnknownName


class NotRunnable(ValueError):
    """The drill's fault has no injector for this environment (the message says why)."""


class NoInjector(UnknownName, NotRunnable):
    """No injector is registered for the fault's kind (the message lists those that are)."""


class Injector(Protocol):
    """Injects one fault at its start and heals it at its end.

    `observe` reports the invariants the injector can see (chaos.drill.Invariant names),
    called once after the load has ended, with the run's history.
    """

    async def inject(self) -> None: ...

    async def heal(self) -> None: ...

    async def observe(self, history: History) -> Mapping[str, bool]: ...


InjectorFactory = Callable[[Fault, DrillEnvironment], Injector]


class PreparesFabric(Protocol):
    """Optional hooks of an injector class: `prepare(fault, spec)` adjusts the FabricSpec
    before it starts (a deployment, a setting); `unavailable()` says why this machine cannot
    inject the fault (no root for a mount), None when it can."""

    @staticmethod
    def prepare(fault: Fault, spec: FabricSpec) -> None: ...

    @staticmethod
    def unavailable() -> str | None: ...


INJECTORS: Registry[InjectorFactory] = Registry(
    "fault injector", builtins={kind.value: fault.injector for kind, fault in FAULTS.items()})


def _registered(kind: str) -> InjectorFactory | None:
    """The injector class of `kind`, whose optional static hooks (PreparesFabric) are read; None without one."""
    return INJECTORS.get(kind) if kind in INJECTORS else None


def unavailable(kind: str) -> str | None:
    """Why this machine cannot inject `kind` (its injector's own check); None when it can."""
    check: Callable[[], str | None] | None = getattr(_registered(kind), "unavailable", None)
    return check() if check is not None else None


def supported_kinds() -> list[str]:
    """Fault kinds the local runner can inject."""
    return INJECTORS.names()


def prepare_fabric(fault: Fault, spec: FabricSpec) -> None:
    """Let the fault's injector adjust the fabric it will run against (before it starts)."""
    prepare: Callable[[Fault, FabricSpec], None] | None = getattr(_registered(fault.kind), "prepare", None)
    if prepare is not None:
        prepare(fault, spec)


def create_injector(fault: Fault, env: DrillEnvironment) -> Injector:
    """The injector for `fault`; NoInjector (a NotRunnable) when there is none."""
    try:
        factory = INJECTORS.get(fault.kind)
    except UnknownName as exc:
        raise NoInjector(exc.kind, exc.name, exc.known) from None
    return factory(fault, env)
