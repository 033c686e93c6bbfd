"""Run a whole fabric on one machine as local processes (`meridian demo`, e2e tests).

Control plane (SQLite), geo router and one data-plane node per region, each a separate
`python -m meridian …` process, started in dependency order and stopped in reverse:
nodes drain first, then the router, then the control plane. Nothing here imports a
plane: processes are started through the CLI and spoken to over HTTP only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from meridian.security import generate_api_key

DEMO_REGIONS = ("aws:us-east-1", "gcp:europe-west4", "onprem:tokyo-1")
DEMO_MODEL = "tiny-llama"

_PR_SET_PDEATHSIG = 1


class FabricError(RuntimeError):
    """The local fabric could not be started (the message says which process and why)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_or_free(preferred: int | None, host: str) -> int:
    if preferred:
        with socket.socket() as s:
            try:
                s.bind((host, preferred))
                return preferred
            except OSError:
                pass
    return free_port(host)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # A child must not outlive the launcher, even when the launcher is SIGKILLed.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class FabricSpec:
    """What to start. Ports of 0 mean "pick a free one"."""

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


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log: Path
    region: str | None = None
    node_id: str | None = None


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


def _node_id(region: str) -> str:
    return "node-" + region.replace(":", "-")


class LocalFabric:
    """Starts and stops a local fabric; use as a context manager so it always stops."""

    def __init__(self, spec: FabricSpec, on_step: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self._on_step = on_step or (lambda _msg: None)
        self._procs: list[Proc] = []
        self.info: FabricInfo | None = None
        self._cluster_token = secrets.token_urlsafe(32)
        self._admin_key = generate_api_key()

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> FabricInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def processes(self) -> list[Proc]:
        return list(self._procs)

    def start(self) -> FabricInfo:
        """Start everything and wait until the router serves the model in every region."""
        spec = self.spec
        spec.work_dir.mkdir(parents=True, exist_ok=True)
        (spec.work_dir / "logs").mkdir(exist_ok=True)
        try:
            model_dir = self._ensure_model()
            cp = self._start_control_plane()
            keys = self._create_keys(cp.url)
            for i, region in enumerate(spec.regions):
                port = spec.node_ports[i] if i < len(spec.node_ports) else 0
                self._start_node(region, model_dir, cp.url, port)
            router = self._start_router(cp.url)
            self.info = FabricInfo(
                router_url=router.url,
                control_plane_url=cp.url,
                admin_key=self._admin_key,
                cluster_token=self._cluster_token,
                keys=keys,
                nodes={p.region: p for p in self._procs if p.region},
            )
            self._wait_serving()
            self._write_state()
            return self.info
        except BaseException:
            self.stop()
            raise

    def stop(self, on_stopped: Callable[[str], None] | None = None) -> None:
        """Drain nodes (SIGTERM), then stop the router and the control plane; kill stragglers."""
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
                    p.popen.wait(timeout=10)
                if on_stopped:
                    on_stopped(p.name)
        self._procs.clear()

    def kill_node(self, region: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Fault injection: signal the node of a region (SIGKILL by default) and reap it."""
        for p in self._procs:
            if p.region == region:
                p.popen.send_signal(sig)
                if sig in (signal.SIGKILL, signal.SIGTERM):
                    p.popen.wait(timeout=30)
                return
        raise KeyError(region)

    # -- steps -----------------------------------------------------------------------

    def _ensure_model(self) -> Path:
        model_dir = self.spec.work_dir / "models" / self.spec.model_name
        if not (model_dir / "model.safetensors").exists():
            self._on_step(f"generating tiny checkpoint {model_dir}")
            self._run_cli(["model", "make-tiny", str(model_dir), "--seed", str(self.spec.seed)])
        return model_dir

    def _start_control_plane(self) -> Proc:
        port = _port_or_free(self.spec.control_plane_port, self.spec.host)
        db = (self.spec.work_dir / "state.db").resolve()
        env = {
            "MERIDIAN_CP_BOOTSTRAP_ADMIN_KEY": self._admin_key,
            "MERIDIAN_CP_HEARTBEAT_INTERVAL_S": str(self.spec.heartbeat_interval_s),
            "MERIDIAN_CP_NODE_TTL_S": str(self.spec.node_ttl_s),
        }
        args = ["control-plane", "serve", "--host", self.spec.host, "--port", str(port),
                "--database-url", f"sqlite:///{db}"]
        p = self._spawn("control-plane", args, env, f"http://{self.spec.host}:{port}")
        self._wait_http(p, "/health")
        return p

    def _create_keys(self, cp_url: str) -> dict[str, str]:
        keys: dict[str, str] = {}
        headers = {"authorization": f"Bearer {self._admin_key}"}
        with httpx.Client(base_url=cp_url, headers=headers, timeout=10.0) as http:
            for zone in ("global", "eu", "us", "apac"):
                r = http.post("/v1/api-keys", json={
                    "name": f"demo-{zone}", "tenant": f"demo-{zone}", "zone": zone,
                    "scopes": ["inference"], "models": None,
                })
                if r.status_code != 201:
                    raise FabricError(f"creating the {zone} key failed: {r.status_code} {r.text}")
                keys[zone] = r.json()["key"]
        return keys

    def _start_node(self, region: str, model_dir: Path, cp_url: str, port: int) -> Proc:
        port = _port_or_free(port, self.spec.host)
        node_id = _node_id(region)
        args = ["node", "run", "--model-dir", str(model_dir), "--model-name", self.spec.model_name,
                "--region", region, "--node-id", node_id, "--host", self.spec.host,
                "--port", str(port), "--control-plane-url", cp_url]
        env = {"MERIDIAN_NODE_DRAIN_TIMEOUT_S": str(self.spec.drain_timeout_s)}
        p = self._spawn(node_id, args, env, f"http://{self.spec.host}:{port}")
        p.region, p.node_id = region, node_id
        return p

    def _start_router(self, cp_url: str) -> Proc:
        port = _port_or_free(self.spec.router_port, self.spec.host)
        args = ["router", "serve", "--host", self.spec.host, "--port", str(port),
                "--control-plane-url", cp_url,
                "--snapshot-path", str((self.spec.work_dir / "routing-table.json").resolve()),
                "--default-client-location", self.spec.default_client_location]
        return self._spawn("router", args, {}, f"http://{self.spec.host}:{port}")

    def _wait_serving(self) -> None:
        """Every node healthy, and the router able to route to each of them."""
        assert self.info is not None
        for p in self._procs:
            self._on_step(f"waiting for {p.name}")
            self._wait_http(p, "/health")
        deadline = time.monotonic() + self.spec.start_timeout_s
        want = {p.node_id for p in self._procs if p.node_id}
        headers = {"authorization": f"Bearer {self.info.admin_key}"}
        with httpx.Client(timeout=5.0) as http:
            while True:
                self._check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    nodes = http.get(f"{self.info.control_plane_url}/v1/nodes", headers=headers).json()
                    ready = {n["node_id"] for n in nodes if n["status"] == "ready"}
                    r = http.get(f"{self.info.router_url}/v1/models",
                                 headers={"authorization": f"Bearer {self.info.keys['global']}"})
                    served = r.status_code == 200 and any(
                        m["id"] == self.spec.model_name for m in r.json().get("data", []))
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
            "control_plane_url": self.info.control_plane_url,
            "admin_key": self.info.admin_key,
            "keys": self.info.keys,
            "pids": {p.name: p.popen.pid for p in self._procs},
        }
        path = self.spec.work_dir / "fabric.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=2)
        os.replace(tmp, path)

    # -- process plumbing ------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
        env["MERIDIAN_CLUSTER_TOKEN"] = self._cluster_token
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _run_cli(self, args: list[str]) -> None:
        r = subprocess.run([sys.executable, "-m", "meridian", *args], env=self._base_env(),
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise FabricError(f"meridian {' '.join(args)} failed:\n{r.stderr[-2000:]}")

    def _spawn(self, name: str, args: list[str], env: dict[str, str], url: str) -> Proc:
        log = self.spec.work_dir / "logs" / f"{name}.log"
        self._on_step(f"starting {name} at {url}")
        full_env = {**self._base_env(), **env}
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "meridian", *args], env=full_env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # Own session: a terminal's Ctrl-C reaches only the launcher, which then
                # stops the processes in order.
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        p = Proc(name=name, popen=popen, url=url, log=log)
        self._procs.append(p)
        return p

    def _check_alive(self) -> None:
        for p in self._procs:
            if p.popen.poll() is not None:
                tail = p.log.read_text(errors="replace")[-3000:] if p.log.exists() else ""
                raise FabricError(f"{p.name} exited with code {p.popen.returncode}:\n{tail}")

    def _wait_http(self, p: Proc, path: str) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        with httpx.Client(timeout=2.0) as http:
            while True:
                self._check_alive()
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
