"""The local fabric as the e2e tests run it: real subprocesses on free ports, with node
timings generous enough that a loaded CI machine never sees a healthy node expire."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from localfabric import FabricSpec, LocalFabric

# Heartbeats every 0.5 s against a 6 s TTL: a node must miss twelve in a row to be lost.
E2E_TIMINGS: dict[str, Any] = {"heartbeat_interval_s": 0.5, "node_ttl_s": 6.0, "drain_timeout_s": 5.0}


def e2e_spec(work_dir: Path, **overrides: Any) -> FabricSpec:
    """A fabric spec with the e2e timings; `overrides` set any other field."""
    return FabricSpec(work_dir=work_dir, **(E2E_TIMINGS | overrides))


def running(spec: FabricSpec) -> Iterator[LocalFabric]:
    """For a fixture to `yield from`: the fabric started, and stopped when the fixture ends."""
    fabric = LocalFabric(spec)
    with fabric:
        yield fabric
