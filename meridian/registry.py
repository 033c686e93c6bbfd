"""One registry of named extension points: providers, drivers, engines, weight origins,
routing policies, chaos fault injectors.

Every extension point of Meridian is a small `typing.Protocol` plus a `Registry` of
factories (or objects) by name. Built-ins are given as `"module:attr.path"` strings and
imported on first use, so that a CPU node never imports vLLM, a router never imports a
cloud SDK, and a provider's SDK is loaded only where that provider is used. Anything may
register more under a new name, or replace a built-in, before it is looked up.

An unknown name is always the same error, `UnknownName`, which names the kind and lists
what is known, so that a typo in a setting reads the same wherever it is made.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class UnknownName(LookupError):
    """No entry of this kind is registered under that name."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = known
        listed = ", ".join(known) if known else "none"
        super().__init__(f"unknown {kind} {name!r}; known: {listed}")


def load_target(target: str) -> object:
    """The object a `"module:attr.path"` string names (imports the module)."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"registry target {target!r} is not 'module:attribute'")
    obj: object = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


class Registry(Generic[T]):
    """Entries of one kind by name; built-ins load lazily from `"module:attr"` strings.

    A registry is a plain object: a module may hold the process-wide one of its kind, and
    an app that needs its own (the control plane's providers, in tests several apps in one
    process) takes a `copy()`.
    """

    def __init__(self, kind: str, builtins: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, T | str] = dict(builtins or {})

    def register(self, name: str, entry: T) -> T:
        """Make `entry` the one called `name` (replacing a built-in of that name)."""
        if not name:
            raise ValueError(f"a {self.kind} needs a name")
        self._entries[name] = entry
        return entry

    def register_as(self, name: str) -> Callable[[T], T]:
        """Decorator form of `register`."""

        def add(entry: T) -> T:
            return self.register(name, entry)

        return add

    def unregister(self, name: str) -> None:
        """Forget `name` (no error when it is not there)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry called `name`, imported now if it is a lazy built-in; UnknownName else."""
        try:
            entry = self._entries[name]
        except KeyError:
            # str(): a name given as a StrEnum member is said as its value, as it is listed.
            raise UnknownName(self.kind, str(name), self.names()) from None
        if isinstance(entry, str):
            entry = cast(T, load_target(entry))
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def copy(self) -> Registry[T]:
        """A registry of its own with the same entries."""
        other: Registry[T] = Registry(self.kind)
        other._entries = dict(self._entries)
        return other

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
