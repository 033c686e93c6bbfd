"""What a local fabric starts (FabricSpec and its deployments and node placements) and
what it hands back once started (FabricInfo, with each process as a Proc)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meridian.admin_api import DeploymentUpsert
from meridian.contracts import GLOBAL_ZONE, DisaggregationSpec, NodeRole

DEMO_REGIONS = ("aws:us-east-1", "gcp:europe-west4", "onprem:tokyo-1")
DEMO_MODEL = "tiny-llama"


@dataclass(frozen=True)
class LocalDeployment:
    """A deployment created at start-up, served from the fabric's tiny checkpoint.

    With min_replicas=0 it has no node until a router asks for one (scale-from-zero). With a
    `disaggregation` its prefill and decode pools are separate nodes, which the local scaler
    starts in their roles (min/max_replicas then bound the decode pool).
    """

    model_name: str
    zone: str = GLOBAL_ZONE
    min_replicas: int = 0
    max_replicas: int = 1
    disaggregation: DisaggregationSpec | None = None

    def upsert(self) -> DeploymentUpsert:
        """The body of the PUT that creates it."""
        return DeploymentUpsert(zone=self.zone, min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                                disaggregation=self.disaggregation)


@dataclass(frozen=True)
class NodePlacement:
    """Where a node runs instead of this host's loopback: a command prefix that enters its
    network namespace (`ip netns exec NAME`) and the address it binds and advertises there."""

    command_prefix: tuple[str, ...]
    host: str


@dataclass
class FabricSpec:
    """What to start. Ports of 0 mean "pick a free one"; `regions` may be empty."""

    work_dir: Path
    regions: tuple[str, ...] = DEMO_REGIONS
    model_name: str = DEMO_MODEL
    seed: int = 0
    host: str = "127.0.0.1"
    router_port: int = 0
    control_plane_port: int = 0
    node_ports: tuple[int, ...] = ()
    heartbeat_interval_s: float = 1.0
    node_ttl_s: float = 5.0
    default_client_location: str = "aws:us-east-1"
    drain_timeout_s: float = 10.0
    start_timeout_s: float = 180.0
    deployments: tuple[LocalDeployment, ...] = ()
    # Register the served model (its shape read from the weight origin) and a deployment of it in
    # zone global, sized to the nodes started for it, so that `meridian models` and `meridian
    # deployments list` show what the fabric serves (`meridian demo`). Min = max = those nodes: the
    # autoscaler then never asks for more or fewer, and the local scaler (for `deployments`
    # only) never starts one. Not with region_roles (a disaggregated fabric declares its own).
    register_served_model: bool = False
    # Run the local scaler when deployments are declared, polling the control plane this often.
    local_scaler: bool = True
    scaler_interval_s: float = 0.5
    # Nodes started in each region (benchmarks run several replicas in one region), and
    # per-region exceptions to it.
    nodes_per_region: int = 1
    region_nodes: dict[str, int] = field(default_factory=dict)
    # Prefill/decode disaggregated regions: the role of each node started there (e.g.
    # ("prefill", "decode", "decode")), instead of region_nodes' co-located count.
    region_roles: dict[str, tuple[NodeRole, ...]] = field(default_factory=dict)

    # Serve this checkpoint instead of generating the tiny one (its name is model_name): it is
    # pushed to the fabric's file:// origin (again when its files change).
    model_dir: Path | None = None
    # Or serve the model already pushed to this weight URI (s3://, gs://, https://, file://):
    # nodes pull it from there; routers then have no tokenizer for it (no local copy).
    model_uri: str | None = None
    # The nodes' engine: "torch" (starts in seconds) or "vllm" (vLLM's CPU build from
    # `make vllm` where there is no GPU; the tiny checkpoint is then shaped for it).
    engine: str = "torch"
    # Extra environment of every node / of the router (e.g. MERIDIAN_ROUTER_ROUTING_POLICY).
    node_env: dict[str, str] = field(default_factory=dict)
    router_env: dict[str, str] = field(default_factory=dict)
    # Routers started against the first control-plane replica.
    routers: int = 1
    # The control plane's database (postgresql://…; None: a SQLite file in work_dir), and its
    # replicas: more than one needs a shared database, and only the first serves nodes and
    # routers (the others contend for leadership of the fleet loops).
    database_url: str | None = None
    control_plane_replicas: int = 1
    control_plane_env: dict[str, str] = field(default_factory=dict)
    # The address control-plane replicas bind (default `host`): one that nodes placed in
    # network namespaces can reach too, such as a bridge's.
    control_plane_host: str | None = None
    # Called with (node_id, region) before a node starts: a NodePlacement runs it elsewhere
    # (its own network namespace, as a separate host), None here.
    node_placement: Callable[[str, str], NodePlacement | None] | None = None
    # With a directory, each router and node journals what it routed and served there
    # (<name>.jsonl, meridian.request_journal): the histories chaos drills check.
    journal_dir: Path | None = None
    # Called with (node_id, port) before a node starts; returns the URL the node advertises
    # instead of its own (a chaos drill's fault-injecting proxy in front of it).
    node_front: Callable[[str, int], str] | None = None

    def nodes_in(self, region: str) -> int:
        """How many nodes start in `region`."""
        roles = self.region_roles.get(region)
        return len(roles) if roles else self.region_nodes.get(region, self.nodes_per_region)

    def roles_in(self, region: str) -> tuple[NodeRole, ...]:
        """The role of each node that starts in `region` (co-located unless region_roles says)."""
        return self.region_roles.get(region) or (NodeRole.BOTH,) * self.nodes_in(region)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log: Path
    # What started it, so that restart() starts it again the same way (same port).
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    command_prefix: tuple[str, ...] = ()
    region: str | None = None
    node_id: str | None = None
    model: str | None = None
    role: NodeRole = NodeRole.BOTH
    # The node's KV event endpoints (ZMQ PUB and replay), which routers subscribe to.
    kv_events: str | None = None
    kv_events_replay: str | None = None


@dataclass
class FabricInfo:
    router_url: str
    control_plane_url: str
    admin_key: str
    # What routers present to nodes and nodes to the control plane.
    cluster_token: str
    # Inference keys by residency zone ("global", "eu", "us", "apac").
    keys: dict[str, str]
    nodes: dict[str, Proc] = field(default_factory=dict)
    # Every router's URL, the first being router_url.
    router_urls: list[str] = field(default_factory=list)
    # Every router's gRPC listener (host:port, KServe v2), in router_urls' order.
    grpc_targets: list[str] = field(default_factory=list)
    # Every control-plane replica's URL, the first being control_plane_url.
    control_plane_urls: list[str] = field(default_factory=list)
    # What a scraper presents to the routers' and the control plane's /metrics.
    metrics_token: str = ""
