"""What an attack is aimed at: a fresh control plane and router, real processes on loopback,
and their resident memory as /proc reports it.

Contract: `attack_fabric(work_dir, router_env)` starts `meridian control-plane serve` and
`meridian router serve` through the local fabric (localfabric, over the CLI: the same
processes a deployment runs, with their listener limits), with no node and no model, and
yields their addresses and pids, the admin key and an inference key; everything stops on
exit. Each attack gets a fabric of its own, so the memory one attack leaves behind is never
another's idle size.

Why no node: every attack is on a listener (HTTP/1.1, HTTP/2, the Responses WebSocket),
and none needs a model answer; the well-behaved neighbour's keyed request (`/v1/models`)
still authenticates against the tenant table the control plane serves, and a revoked key
leaves that table as it would in production.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from localfabric import FabricSpec, local_fabric

# Nothing is served from it: with no region there is no node to pull it, but the fabric then
# generates no checkpoint either (a start of ~3 s instead of ~15 s).
NO_MODEL_URI = "file:///nonexistent/attack-model"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Listener:
    """One process's public HTTP listener: what an attack connects to, whose memory it watches."""

    name: str
    url: str
    pid: int

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        assert port is not None, self.url
        return port


@dataclass(frozen=True)
class AttackFabric:
    router: Listener
    control_plane: Listener
    admin_key: str
    # An inference key of tenant demo-global (zone global).
    tenant_key: str

    def listener(self, name: str) -> Listener:
        return self.router if name == self.router.name else self.control_plane


@contextlib.contextmanager
def attack_fabric(work_dir: Path, router_env: Mapping[str, str] | None = None) -> Iterator[AttackFabric]:
    """A control plane and a router (with `router_env` over its settings), stopped on exit."""
    spec = FabricSpec(work_dir=work_dir, regions=(), model_uri=NO_MODEL_URI, router_env=dict(router_env or {}))
    with local_fabric(spec) as fabric:
        info = fabric.info
        assert info is not None
        procs = {p.name: p for p in fabric.processes}
        yield AttackFabric(
            router=Listener("router", info.router_url, procs["router"].popen.pid),
            control_plane=Listener("control-plane", info.control_plane_url, procs["control-plane"].popen.pid),
            admin_key=info.admin_key,
            tenant_key=info.keys["global"],
        )


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (VmRSS) or at its peak (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / MIB
    raise LookupError(f"/proc/{pid}/status has no {field}")


def reset_peak(pid: int) -> bool:
    """Start the process's VmHWM afresh from its present RSS (Linux >= 4.0: clear_refs 5), so
    that the peak read later is the attack's, not the start-up's; False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True
