"""Run a whole fabric on one machine as local processes (`meridian demo`, e2e tests).

Control plane (SQLite), geo router and one data-plane node per region, each a separate
`python -m cli …` process, started in dependency order and stopped in reverse:
nodes drain first, then the router, then the control plane. Nothing here imports a
plane: processes are started through the CLI and spoken to over HTTP only.

Each node publishes its KV cache events (and serves their replay) on ZMQ ipc sockets in
a private temporary directory: the publisher binds only wildcard TCP hosts, and a socket
file readable by this user alone keeps the prompts' token ids off the network. Nodes
advertise these endpoints, so the router builds its KV-prefix index from them.

Deployments declared in the spec are created in the control plane (and, for `meridian demo`,
the served model and a deployment sized to its nodes: FabricSpec.register_served_model). With
one declared in the spec, a small local scaler (a thread) starts a node whenever a
deployment's desired_replicas exceeds the nodes it has, which is how scale-from-zero works on
one machine. It never stops nodes: scaling down and real provider drivers belong to the
reconciler.

Settings: every child inherits the launcher's `MERIDIAN_*` environment (so that
`MERIDIAN_ROUTER_OTLP_ENDPOINT=… meridian demo` turns tracing on), under what the fabric
sets for each process itself, which wins: its flags (hosts, ports, URLs, model, node id),
the cluster and metrics tokens, the spec's per-process environment, journals, caches and
KV sockets. Settings that would make the children collide or stop speaking plain HTTP on
their loopback ports (`FABRIC_OWNED`: other hosts and ports, one journal or advertised
URL for every node, a node role, TLS, a config file) are not passed on at all.

The routers' and the control plane's /metrics answer the fabric's own metrics token
(FabricInfo.metrics_token, `metrics_token` in fabric.json): a scraper needs no cluster token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from meridian.admin_api import ApiKeyCreate, Scope
from meridian.admin_client import AdminAPIError, AdminClient
from meridian.contracts import GLOBAL_ZONE, DeploymentView, NodeRole, NodeStatus, RegionInfo
from meridian.security import generate_api_key
from meridian.settings import LogSettings

from .checkpoint import origin_holds
from .procs import die_with_parent, fabric_port, port_or_free, renice
from .scaling import LocalNode, nodes_to_start
from .spec import FabricInfo, FabricSpec, Proc

logger = logging.getLogger(__name__)


class FabricError(RuntimeError):
    """The local fabric could not be started (the message says which process and why)."""


# Settings that, the same in every child, would make its processes collide or stop speaking
# plain HTTP on the fabric's loopback ports: addresses and ports, per-process files and
# identities, a node's role and engine (--engine), TLS, a config file.
FABRIC_OWNED = re.compile(
    r"^MERIDIAN_(CONFIG|(CP|ROUTER|NODE)_(\w+_)?(HOST|PORT)"
    r"|(ROUTER|NODE)_REQUEST_JOURNAL_PATH|ROUTER_TLS_(CERT|KEY)_FILE"
    r"|NODE_(ADVERTISE_URL|MODEL_DIR|KV_EVENTS(_REPLAY)?_ADVERTISE|ROLE|ENGINE))$"
)


def passed_through(environ: dict[str, str]) -> dict[str, str]:
    """The launcher's environment as every child inherits it: all of it but FABRIC_OWNED."""
    return {k: v for k, v in environ.items() if not FABRIC_OWNED.match(k)}


def _node_id(region: str) -> str:
    return "node-" + region.replace(":", "-")


def _slug(text: str, limit: int) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", text.lower()).strip("-.")[:limit] or "x"


def vllm_node_spec(model_name: str) -> dict[str, object]:
    """The deployment spec of a fabric's vLLM node: sized for a shared CPU host (KV cache in
    host memory, threads not pinned to cores), with tool calling on as a deployment would set
    it: without it vLLM refuses tools with the default tool_choice ("auto"). The pythonic
    parser reads calls written as Python in the model's text, so it needs nothing of the model
    (SmolLM2's chat template renders no tools); named and "required" tool choices are vLLM's
    structured output whatever the parser.

    float32, as the fabric's checkpoints are written: vLLM's CPU build would otherwise run them
    in bfloat16, and its compiled bfloat16 path answers SmolLM2's "What is the capital of
    France?" with noise where float32 (or bfloat16 run eagerly) answers "Paris"."""
    return {
        "name": model_name, "model": model_name, "dtype": "float32", "max_model_len": 2048, "max_num_seqs": 16,
        "cpu_kvcache_space_gib": 1, "cpu_threads_bind": "nobind",
        "extra_args": ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"],
    }


class LocalFabric:
    """Starts and stops a local fabric; use as a context manager so it always stops."""

    def __init__(self, spec: FabricSpec, on_step: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self._on_step = on_step or (lambda _msg: None)
        self._procs: list[Proc] = []
        # The scaler thread starts nodes while the caller may kill or stop them.
        self._lock = threading.RLock()
        self._scaler: threading.Thread | None = None
        self._scaler_stop = threading.Event()
        self._scaled = 0
        self._routers = 0
        self._grpc_targets: list[str] = []
        # Holds the nodes' KV event sockets; short, as a socket path may not exceed ~100 bytes.
        self._kv_dir: Path | None = None
        self._kv_sockets = 0
        self.info: FabricInfo | None = None
        self._cluster_token = secrets.token_urlsafe(32)
        # What a scraper presents to the routers' and the control plane's /metrics: it reads
        # metrics only, where the cluster token would let it register nodes.
        self._metrics_token = secrets.token_urlsafe(32)
        self._admin_key = generate_api_key()
        # Its control plane reports it on /health and fabric.json records it: the CLI then knows
        # that what answers on the recorded port is this fabric's control plane, not a later one.
        self._instance_id = f"fabric-{secrets.token_hex(8)}"
        self._model_uri = ""
        self._replacements = 0

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> FabricInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def processes(self) -> list[Proc]:
        with self._lock:
            return list(self._procs)

    def scaled_nodes(self, model: str | None = None) -> list[Proc]:
        """Nodes the local scaler started (for `model`, when given)."""
        with self._lock:
            return [p for p in self._procs if p.name.startswith("scaled-") and model in (None, p.model)]

    def start(self) -> FabricInfo:
        """Start everything and wait until the router serves the model in every region."""
        spec = self.spec
        spec.work_dir.mkdir(parents=True, exist_ok=True)
        (spec.work_dir / "logs").mkdir(exist_ok=True)
        try:
            model_uri = self._model_uri = self._ensure_model()
            if spec.control_plane_replicas > 1 and spec.database_url is None:
                raise FabricError("several control-plane replicas need a shared database (database_url)")
            cp = self._start_control_plane()
            standbys = [self._start_control_plane(i) for i in range(2, spec.control_plane_replicas + 1)]
            keys = self._create_keys(cp.url)
            self._create_deployments(cp.url)
            if spec.register_served_model and not spec.region_roles:
                self._register_served_model(cp.url, model_uri)
            i = 0
            for region in spec.regions:
                for k, role in enumerate(spec.roles_in(region)):
                    port = spec.node_ports[i] if i < len(spec.node_ports) else 0
                    node_id = _node_id(region) + (f"-{k + 1}" if spec.nodes_in(region) > 1 else "")
                    if role is not NodeRole.BOTH:
                        node_id = f"{_node_id(region)}-{role.value}-{k + 1}"
                    self._start_node(region, model_uri, cp.url, port, node_id=node_id, role=role)
                    i += 1
            routers = [self._start_router(cp.url, spec.router_port, spec.router_env)]
            routers += [self._start_router(cp.url, 0, spec.router_env) for _ in range(spec.routers - 1)]
            self.info = FabricInfo(
                router_url=routers[0].url,
                control_plane_url=cp.url,
                control_plane_urls=[cp.url, *(p.url for p in standbys)],
                admin_key=self._admin_key,
                cluster_token=self._cluster_token,
                metrics_token=self._metrics_token,
                keys=keys,
                nodes={p.region: p for p in self._procs if p.region},
                router_urls=[r.url for r in routers],
                grpc_targets=list(self._grpc_targets),
            )
            self._wait_serving()
            self._write_state()
            if spec.deployments and spec.local_scaler:
                self._scaler = threading.Thread(
                    target=self._run_scaler, args=(model_uri, cp.url), name="local-scaler", daemon=True
                )
                self._scaler.start()
            return self.info
        except BaseException:
            self.stop()
            raise

    def stop(self, on_stopped: Callable[[str], None] | None = None) -> None:
        """Drain nodes (SIGTERM), then stop the router and the control plane; kill stragglers."""
        self._scaler_stop.set()
        if self._scaler is not None:
            self._scaler.join(timeout=30)
            self._scaler = None
        with self._lock:
            nodes = [p for p in self._procs if p.region]
            others = [p for p in reversed(self._procs) if not p.region]
        for group, grace in ((nodes, self.spec.drain_timeout_s + 5), *(([p], 10.0) for p in others)):
            for p in group:
                if p.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in group:
                try:
                    p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    try:
                        p.popen.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        # One process the kernel has not reaped yet must not leave the rest of
                        # the fabric (the router, the control plane) running.
                        logger.warning("%s (pid %d) not reaped 10 s after SIGKILL", p.name, p.popen.pid)
                if on_stopped:
                    on_stopped(p.name)
        with self._lock:
            self._procs.clear()
        if self._kv_dir is not None:
            shutil.rmtree(self._kv_dir, ignore_errors=True)
            self._kv_dir = None

    @property
    def node_processes(self) -> list[Proc]:
        """Every node process, the scaled ones included."""
        return [p for p in self.processes if p.node_id]

    def kill_node(self, region: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Fault injection: signal the (first) node of a region (SIGKILL by default) and reap it."""
        for p in self.processes:
            if p.region == region:
                p.popen.send_signal(sig)
                if sig in (signal.SIGKILL, signal.SIGTERM):
                    p.popen.wait(timeout=30)
                return
        raise KeyError(region)

    def kill_region(self, region: str, sig: signal.Signals = signal.SIGKILL) -> list[str]:
        """Fault injection: signal every node of a region at once, then reap them; their ids."""
        victims = [p for p in self.processes if p.region == region and p.popen.poll() is None]
        if not victims:
            raise KeyError(region)
        for p in victims:
            p.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            for p in victims:
                p.popen.wait(timeout=30)
        return [p.node_id or p.name for p in victims]

    def restart(self, proc: Proc, niceness: int = 0, env: dict[str, str] | None = None) -> Proc:
        """Start a process that exited (crashed, killed by a drill) again, with the same
        arguments, environment and port; the returned Proc replaces it. Does not wait.

        A positive `niceness` starts it at a lower CPU priority: on one machine a node's cold
        start (imports, loading) otherwise takes its CPU from the nodes serving traffic,
        which separate machines would not (renice() it back once it is up). `env` is laid
        over its environment (and kept for later restarts).
        """
        if proc.popen.poll() is None:
            raise FabricError(f"{proc.name} is still running (pid {proc.popen.pid})")
        fresh = self._spawn(proc.name, proc.args, {**proc.env, **(env or {})}, proc.url, niceness,
                            proc.command_prefix)
        fresh.region, fresh.node_id, fresh.model, fresh.role = proc.region, proc.node_id, proc.model, proc.role
        fresh.kv_events, fresh.kv_events_replay = proc.kv_events, proc.kv_events_replay
        with self._lock:
            self._procs = [p for p in self._procs if p is not proc]
        return fresh

    def new_node_id(self, region: str) -> str:
        """A node id not used yet in `region` (for a node started while the fabric runs)."""
        with self._lock:
            self._replacements += 1
            return f"{_node_id(region)}-r{self._replacements}"

    def node_cache_dir(self, node_id: str) -> Path:
        """The weight cache directory of a node (each node has its own, as on its own disk)."""
        return (self.spec.work_dir / "weights" / node_id).resolve()

    @property
    def origin_dir(self) -> Path:
        """The file:// weight origin the nodes pull the model from."""
        return (self.spec.work_dir / "origin" / self.spec.model_name).resolve()

    def start_replacement_node(self, region: str, niceness: int = 0, node_id: str | None = None,
                               env: dict[str, str] | None = None) -> Proc:
        """Start a new node in `region`, as a driver replaces a lost instance: a fresh node id
        unless given, `env` over the nodes' settings, `niceness` as in restart()."""
        assert self.info is not None, "start the fabric first"
        return self._start_node(region, self._model_uri, self.info.control_plane_url, 0,
                                node_id=node_id or self.new_node_id(region), niceness=niceness, env=env)

    def wait_ready(self, proc: Proc, timeout_s: float) -> None:
        """Block until node `proc` is healthy and READY in the control plane."""
        assert self.info is not None, "start the fabric first"
        deadline = time.monotonic() + timeout_s
        self.wait_healthy(proc, timeout_s)
        with self._admin(self.info.control_plane_url, 5.0) as admin:
            while time.monotonic() < deadline:
                self._check_alive([proc])
                with contextlib.suppress(AdminAPIError):
                    if any(n.node_id == proc.node_id and n.status == NodeStatus.READY for n in admin.nodes()):
                        return
                time.sleep(0.2)
        raise FabricError(f"{proc.name} was not ready in the control plane within {timeout_s:g}s")

    def wait_healthy(self, proc: Proc, timeout_s: float | None = None) -> None:
        """Block until `proc` answers /health with 200 (FabricError after the start timeout)."""
        self._wait_http(proc, "/health", timeout_s, alone=True)

    def start_router(self, env: dict[str, str] | None = None) -> Proc:
        """Start one more router against the same control plane (e.g. another policy); stopped with the rest."""
        assert self.info is not None, "start the fabric first"
        p = self._start_router(self.info.control_plane_url, 0, {**self.spec.router_env, **(env or {})})
        self._wait_http(p, "/health")
        key = self.info.keys["global"]
        deadline = time.monotonic() + self.spec.start_timeout_s
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    r = http.get(f"{p.url}/v1/models", headers={"authorization": f"Bearer {key}"})
                    if r.status_code == 200 and r.json().get("data"):
                        return p
                time.sleep(0.2)
        raise FabricError(f"router {p.name} did not serve in time; see {p.log}")

    # -- steps -----------------------------------------------------------------------

    def _ensure_model(self) -> str:
        """The weight URI nodes pull from: the spec's model_uri as given, else its model_dir or
        the tiny checkpoint (generated here), pushed to a file:// weight origin (the embedded
        default); nodes pull it into their own caches, as GPU nodes pull from S3/GCS."""
        if self.spec.model_uri is not None:
            return self.spec.model_uri
        vllm = self.spec.engine == "vllm"
        model_dir = self.spec.model_dir or self.spec.work_dir / "models" / (
            self.spec.model_name + ("-vllm" if vllm else ""))
        origin = self.origin_dir
        if self.spec.model_dir is None and not (model_dir / "model.safetensors").exists():
            self._on_step(f"generating tiny checkpoint {model_dir}")
            self._run_cli(["model", "make-tiny", str(model_dir), "--seed", str(self.spec.seed),
                           "--engine", self.spec.engine])
        if not origin_holds(origin, model_dir):
            origin.mkdir(parents=True, exist_ok=True)
            self._on_step(f"pushing {model_dir} to the weight origin file://{origin}")
            self._run_cli(["model", "push", str(model_dir), f"file://{origin}"])
        return f"file://{origin}"

    def _start_control_plane(self, replica: int = 1) -> Proc:
        """Replica 1 is the one nodes and routers use; more replicas share its database."""
        host = self.spec.control_plane_host or self.spec.host
        port = port_or_free(self.spec.control_plane_port if replica == 1 else 0, host)
        database_url = self.spec.database_url or f"sqlite:///{(self.spec.work_dir / 'state.db').resolve()}"
        name = "control-plane" if replica == 1 else f"control-plane-{replica}"
        env = {
            "MERIDIAN_CP_BOOTSTRAP_ADMIN_KEY": self._admin_key,
            "MERIDIAN_CP_HEARTBEAT_INTERVAL_S": str(self.spec.heartbeat_interval_s),
            "MERIDIAN_CP_NODE_TTL_S": str(self.spec.node_ttl_s),
            "MERIDIAN_CP_REPLICA_ID": name,
            "MERIDIAN_CP_METRICS_TOKEN": self._metrics_token,
            "MERIDIAN_CP_INSTANCE_ID": self._instance_id,
            **self.spec.control_plane_env,
        }
        args = ["control-plane", "serve", "--host", host, "--port", str(port),
                "--database-url", database_url]
        p = self._spawn(name, args, env, f"http://{host}:{port}")
        self._wait_http(p, "/health")
        return p

    def _admin(self, cp_url: str, timeout_s: float = 10.0) -> AdminClient:
        return AdminClient(cp_url, self._admin_key, timeout_s)

    def _create_keys(self, cp_url: str) -> dict[str, str]:
        keys: dict[str, str] = {}
        with self._admin(cp_url) as admin:
            for zone in (GLOBAL_ZONE, "eu", "us", "apac"):
                try:
                    keys[zone] = admin.create_key(ApiKeyCreate(
                        name=f"demo-{zone}", tenant=f"demo-{zone}", zone=zone, scopes=[Scope.INFERENCE], models=None,
                        create_tenant=True,
                    )).key
                except AdminAPIError as e:
                    raise FabricError(f"creating the {zone} key failed: {e}") from e
        return keys

    def _create_deployments(self, cp_url: str) -> None:
        with self._admin(cp_url) as admin:
            for d in self.spec.deployments:
                try:
                    admin.put_deployment(d.model_name, d.upsert())
                except AdminAPIError as e:
                    raise FabricError(f"creating deployment {d.model_name} failed: {e}") from e

    def _register_served_model(self, cp_url: str, model_uri: str) -> None:
        """The served model and its deployment, through `meridian deploy` (which reads the shape
        from the weight origin, and writes both in one transaction)."""
        nodes = sum(self.spec.nodes_in(r) for r in self.spec.regions)
        deployment = {"name": self.spec.model_name, "model": {"uri": model_uri}, "zone": GLOBAL_ZONE,
                      "min_replicas": nodes, "max_replicas": max(1, nodes)}
        path = self.spec.work_dir / "served-deployment.json"  # JSON is YAML: `meridian deploy -f` reads it
        path.write_text(json.dumps(deployment, indent=2))
        self._on_step(f"registering {self.spec.model_name} and its deployment")
        self._run_cli(["deploy", "-f", str(path.resolve())],
                      {"MERIDIAN_CONTROL_PLANE_URL": cp_url, "MERIDIAN_API_KEY": self._admin_key})

    def _start_node(self, region: str, model_uri: str, cp_url: str, port: int,
                    model_name: str | None = None, node_id: str | None = None, niceness: int = 0,
                    env: dict[str, str] | None = None, role: NodeRole = NodeRole.BOTH) -> Proc:
        model_name = model_name or self.spec.model_name
        node_id = node_id or _node_id(region)
        placement = self.spec.node_placement(node_id, region) if self.spec.node_placement else None
        host = placement.host if placement else self.spec.host
        # A port free on this host is free in a fresh network namespace too.
        port = port_or_free(port, self.spec.host)
        args = ["node", "run", "--model-uri", model_uri, "--model-name", model_name,
                "--region", region, "--node-id", node_id, "--host", host,
                "--port", str(port), "--control-plane-url", cp_url]
        kv_events, kv_events_replay = self._kv_event_endpoints()
        extra_env = env or {}
        env = {
            # Nodes share this machine's cores: torch's default of one thread per core in
            # every node oversubscribes them and a busy fabric slows to a crawl.
            "OMP_NUM_THREADS": str(self._threads_per_node()),
            **self._journal_env("MERIDIAN_NODE_REQUEST_JOURNAL_PATH", node_id),
            "MERIDIAN_NODE_DRAIN_TIMEOUT_S": str(self.spec.drain_timeout_s),
            # One cache per node, as on separate machines.
            "MERIDIAN_WEIGHTS_CACHE_DIR": str(self.node_cache_dir(node_id)),
            "MERIDIAN_NODE_KV_EVENTS_ENDPOINT": kv_events,
            "MERIDIAN_NODE_KV_EVENTS_REPLAY_ENDPOINT": kv_events_replay,
            **self._engine_env(model_name),
            **({"MERIDIAN_NODE_ROLE": role.value} if role is not NodeRole.BOTH else {}),
            **self.spec.node_env,
            **extra_env,
        }
        if self.spec.node_front is not None and placement is None:
            env["MERIDIAN_NODE_ADVERTISE_URL"] = self.spec.node_front(node_id, port)
        p = self._spawn(node_id, args, env, f"http://{host}:{port}", niceness,
                        placement.command_prefix if placement else ())
        p.region, p.node_id, p.model, p.role = region, node_id, model_name, role
        p.kv_events, p.kv_events_replay = kv_events, kv_events_replay
        return p

    def _engine_env(self, model_name: str) -> dict[str, str]:
        """What a node needs to run the fabric's engine: for vLLM, vllm_node_spec's deployment
        spec, rewritten when it differs (a work directory kept from an older demo gets today's)."""
        if self.spec.engine != "vllm":
            return {}
        spec_file = self.spec.work_dir / f"vllm-spec-{model_name}.json"
        text = json.dumps(vllm_node_spec(model_name))
        with self._lock:
            if not spec_file.exists() or spec_file.read_text() != text:
                spec_file.write_text(text)
        return {"MERIDIAN_NODE_ENGINE": "vllm", "MERIDIAN_NODE_DEPLOYMENT_SPEC_FILE": str(spec_file.resolve())}

    def _threads_per_node(self) -> int:
        nodes = max(1, sum(self.spec.nodes_in(r) for r in self.spec.regions))
        return max(1, (os.cpu_count() or 1) // nodes)

    def _journal_env(self, variable: str, name: str) -> dict[str, str]:
        if self.spec.journal_dir is None:
            return {}
        return {variable: str((self.spec.journal_dir / f"{name}.jsonl").resolve())}

    def _kv_event_endpoints(self) -> tuple[str, str]:
        """Fresh (events, replay) ipc endpoints for the next node."""
        with self._lock:
            if self._kv_dir is None:
                self._kv_dir = Path(tempfile.mkdtemp(prefix="meridian-kv-"))  # mode 0700
            self._kv_sockets += 1
            base = self._kv_dir / str(self._kv_sockets)
        return f"ipc://{base}.events", f"ipc://{base}.replay"

    # -- local scaler ----------------------------------------------------------------

    def _run_scaler(self, model_uri: str, cp_url: str) -> None:
        """Until stop(): start nodes for deployments that want more than they have.

        Nodes are spawned from this thread, so their parent-death signal fires when it
        ends; it ends only in stop(), which stops those nodes anyway.
        """
        regions: list[RegionInfo] = []
        with self._admin(cp_url, 5.0) as admin:
            while not self._scaler_stop.wait(self.spec.scaler_interval_s):
                try:
                    regions = regions or admin.regions()
                    for d in admin.deployments():
                        self._scale(d, regions, model_uri, cp_url)
                except AdminAPIError as exc:
                    logger.warning("local scaler: %s; trying again", exc)

    def _scale(self, d: DeploymentView, regions: list[RegionInfo], model_uri: str, cp_url: str) -> None:
        """Start the nodes the deployment wants beyond those it runs (localfabric.scaling): a
        disaggregated deployment's prefill and decode nodes in their roles, up to each pool's count."""
        with self._lock:
            if self._scaler_stop.is_set():
                return
            running = [LocalNode(p.role, p.region or "") for p in self._procs
                       if p.model == d.model and p.popen.poll() is None]
            wanted = nodes_to_start(d, running, regions, self.spec.regions)
            if wanted is None:
                logger.warning("local scaler: no region suits deployment %s (zone %s)", d.model, d.zone)
                return
            for node in wanted:
                self._scaled += 1
                role = "" if node.role is NodeRole.BOTH else f"{node.role.value}-"
                node_id = f"scaled-{_slug(d.model, 40)}-{role}{self._scaled}"
                self._on_step(f"scaling {d.model} up: starting {node_id} in {node.region}")
                self._start_node(node.region, model_uri, cp_url, 0, model_name=d.model, node_id=node_id,
                                 role=node.role)
                self._write_state()

    def _start_router(self, cp_url: str, port: int, env: dict[str, str]) -> Proc:
        port = port_or_free(port, self.spec.host)
        self._routers += 1
        name = "router" if self._routers == 1 else f"router-{self._routers}"
        snapshot = self.spec.work_dir / f"{name.replace('router', 'routing')}-table.json"
        args = ["router", "serve", "--host", self.spec.host, "--port", str(port),
                "--control-plane-url", cp_url,
                "--snapshot-path", str(snapshot.resolve()),
                "--default-client-location", self.spec.default_client_location]
        # The router tokenizes prompts with the model's own tokenizer to match KV blocks (a
        # model served from a URI has no local copy: its requests are routed without it).
        model_dir = (self.spec.model_dir or self.spec.work_dir / "models" / self.spec.model_name).resolve()
        tokenizers = {} if self.spec.model_uri and not self.spec.model_dir else {self.spec.model_name: str(model_dir)}
        # Every router also speaks gRPC (KServe v2): its listener's port is the fabric's choice.
        grpc_port = fabric_port(self.spec.host)
        self._grpc_targets.append(f"{self.spec.host}:{grpc_port}")
        env = {
            # One process unless router_env says otherwise (the demo: every core): drills and
            # benchmarks read one router process's figures.
            "MERIDIAN_ROUTER_WORKERS": "1",
            "MERIDIAN_ROUTER_TOKENIZER_DIRS": json.dumps(tokenizers),
            "MERIDIAN_ROUTER_GRPC_PORT": str(grpc_port),
            "MERIDIAN_ROUTER_METRICS_TOKEN": self._metrics_token,
            **self._journal_env("MERIDIAN_ROUTER_REQUEST_JOURNAL_PATH", name),
            **env,
        }
        return self._spawn(name, args, env, f"http://{self.spec.host}:{port}")

    def _wait_serving(self) -> None:
        """Every node healthy, and the router able to route to each of them."""
        assert self.info is not None
        for p in self._procs:
            self._on_step(f"waiting for {p.name}")
            self._wait_http(p, "/health")
        deadline = time.monotonic() + self.spec.start_timeout_s
        want = {p.node_id for p in self._procs if p.node_id}
        # Without a node of its own the fabric serves nothing until something scales up.
        must_serve = bool(self.spec.regions)
        with self._admin(self.info.control_plane_url, 5.0) as admin, httpx.Client(timeout=5.0) as http:
            while True:
                self._check_alive()
                with contextlib.suppress(httpx.HTTPError, AdminAPIError):
                    ready = {n.node_id for n in admin.nodes() if n.status == NodeStatus.READY}
                    r = http.get(f"{self.info.router_url}/v1/models",
                                 headers={"authorization": f"Bearer {self.info.keys['global']}"})
                    served = not must_serve or (r.status_code == 200 and any(
                        m["id"] == self.spec.model_name for m in r.json().get("data", [])))
                    if want <= ready and served:
                        return
                if time.monotonic() > deadline:
                    raise FabricError("the fabric did not become ready in time; see logs in "
                                      f"{self.spec.work_dir / 'logs'}")
                time.sleep(0.3)

    def _write_state(self) -> None:
        assert self.info is not None
        state = {
            "router_url": self.info.router_url,
            "grpc_target": self.info.grpc_targets[0] if self.info.grpc_targets else None,
            "control_plane_url": self.info.control_plane_url,
            "control_plane_instance_id": self._instance_id,
            "admin_key": self.info.admin_key,
            # The bearer token of the routers' and the control plane's /metrics.
            "metrics_token": self.info.metrics_token,
            "keys": self.info.keys,
            "pids": {p.name: p.popen.pid for p in self.processes},
        }
        path = self.spec.work_dir / "fabric.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=2)
        os.replace(tmp, path)

    # -- process plumbing ------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = passed_through(dict(os.environ))
        env["MERIDIAN_CLUSTER_TOKEN"] = self._cluster_token
        # Every child logs in the launcher's format and level (its environment or config file).
        log = LogSettings()
        env["MERIDIAN_LOG_FORMAT"], env["MERIDIAN_LOG_LEVEL"] = log.format.value, log.level
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _run_cli(self, args: list[str], env: dict[str, str] | None = None) -> None:
        r = subprocess.run([sys.executable, "-m", "cli", *args], env={**self._base_env(), **(env or {})},
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise FabricError(f"meridian {' '.join(args)} failed:\n{r.stderr[-2000:]}")

    def _spawn(self, name: str, args: list[str], env: dict[str, str], url: str, niceness: int = 0,
               command_prefix: tuple[str, ...] = ()) -> Proc:
        log = self.spec.work_dir / "logs" / f"{name}.log"
        self._on_step(f"starting {name} at {url}")
        full_env = {**self._base_env(), **env}
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [*command_prefix, sys.executable, "-m", "cli", *args], env=full_env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # Own session: a terminal's Ctrl-C reaches only the launcher, which then
                # stops the processes in order.
                start_new_session=True, preexec_fn=die_with_parent,
            )
        if niceness:
            # Right after fork: the interpreter is still starting, its threads come later and
            # inherit this.
            renice(popen.pid, niceness)
        p = Proc(name=name, popen=popen, url=url, log=log, args=list(args), env=dict(env),
                 command_prefix=command_prefix)
        with self._lock:
            self._procs.append(p)
        return p

    def _check_alive(self, procs: list[Proc] | None = None) -> None:
        for p in self.processes if procs is None else procs:
            if p.popen.poll() is not None:
                tail = p.log.read_text(errors="replace")[-3000:] if p.log.exists() else ""
                raise FabricError(f"{p.name} exited with code {p.popen.returncode}:\n{tail}")

    def _wait_http(self, p: Proc, path: str, timeout_s: float | None = None, alone: bool = False) -> None:
        """Wait for `p` to answer `path`; fails fast when it (or, unless `alone`, any process) exits."""
        deadline = time.monotonic() + (self.spec.start_timeout_s if timeout_s is None else timeout_s)
        with httpx.Client(timeout=2.0) as http:
            while True:
                self._check_alive([p] if alone else None)
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(p.url + path).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise FabricError(f"{p.name} did not answer {path} in time; see {p.log}")
                time.sleep(0.2)


@contextlib.contextmanager
def local_fabric(spec: FabricSpec, on_step: Callable[[str], None] | None = None) -> Iterator[LocalFabric]:
    """Context manager that yields a started fabric and always stops it."""
    fabric = LocalFabric(spec, on_step)
    fabric.start()
    try:
        yield fabric
    finally:
        fabric.stop()
