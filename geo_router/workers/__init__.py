"""`meridian router serve --workers N`: N router processes on one port, acting as one router.

A Python router is one event loop on one core; a host has many. The supervisor
(geo_router.workers.supervisor) reserves the port, starts N worker processes that each
listen on it with SO_REUSEPORT (the kernel spreads new connections over them), replaces a
worker that dies, and stops them all on SIGTERM. Each worker is a whole router (the app of
geo_router.app); what must be one across them is shared:

- rate limits: exactly, through a bucket table in a file every worker maps
  (geo_router.workers.host_buckets), or through Redis when `redis_url` is set;
- /metrics: whichever worker is scraped gathers every worker's page, each series labelled
  `worker` (geo_router.workers.metrics_pages);
- the prefix history (affinity): at once, through a ring in a mapped file
  (geo_router.workers.host_history), or through Redis when `redis_url` is set;
- node ejections: at once, through another ring (geo_router.workers.host_fleet), or through
  Redis when `redis_url` is set; in-flight counts and failures below the ejection threshold
  stay each worker's own;
- active health probes: one worker at a time probes (it holds a lease, a `flock` the kernel
  lets go of when it dies) and the others read the loads and round trips it found from a
  ring (geo_router.workers.host_probes): a node answers one router's probes, not N;
- the KV index: every worker subscribes to the nodes' KV events itself, so all hold the same;
- the routing table: every worker polls the control plane and writes the snapshot (atomically).

Listener limits (max connections, per-client connections) are per worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """One worker's place among its siblings: what it shares with them, and where."""

    index: int
    count: int
    # The supervisor's private directory (mode 0700): the bucket table, the rings, the metrics
    # sockets.
    state_dir: Path

    @property
    def buckets_path(self) -> Path:
        return self.state_dir / "rate-limit-buckets"

    @property
    def history_path(self) -> Path:
        return self.state_dir / "prefix-history"

    @property
    def fleet_path(self) -> Path:
        return self.state_dir / "node-ejections"

    @property
    def probes_path(self) -> Path:
        return self.state_dir / "probe-news"

    @property
    def probe_lease_path(self) -> Path:
        return self.state_dir / "probe-lease"

    def metrics_socket(self, index: int) -> Path:
        return self.state_dir / f"metrics-{index}.sock"
