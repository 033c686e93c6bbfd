"""The local fabric: a whole Meridian on one machine as local processes.

This is a composition root beside the CLI, not part of the kernel: `meridian demo`, the
chaos drills, the benchmarks and the end-to-end tests start a fabric through it. It
starts every part through the CLI (`python -m cli …`) and speaks to it over HTTP only,
so it imports no plane either.
"""

from .fabric import FabricError, LocalFabric, local_fabric
from .procs import renice
from .spec import DEMO_MODEL, DEMO_REGIONS, FabricInfo, FabricSpec, LocalDeployment, NodePlacement, Proc

__all__ = [
    "DEMO_MODEL",
    "DEMO_REGIONS",
    "FabricError",
    "FabricInfo",
    "FabricSpec",
    "LocalDeployment",
    "LocalFabric",
    "NodePlacement",
    "Proc",
    "local_fabric",
    "renice",
]
