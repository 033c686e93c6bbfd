"""The real processes a fleet point runs against, and how they are measured from outside.

- `scratch_database`: a fresh Postgres database per run (meridian_scale_<pid>_<n>), dropped
  after it, so that a run's writes and its table are its own.
- `ControlPlaneProc` / `RealRouterProc`: `meridian control-plane serve` and `meridian
  router serve` as subprocesses of this one (`python -m cli`, as the local fabric starts
  them), logging to files, stopped with SIGTERM and killed if they linger.
- `cpu_seconds`, `rss_mib`: what a process has used, read from /proc (no psutil: the same
  figures without a dependency).
- `PgCounters`: the database's pg_stat_database counters (commits, rows inserted, updated,
  deleted), whose deltas over a window are the control plane's write rate.
- `LostWatch`: a thread that polls the nodes table for the nodes it is told to watch and
  notes when the control plane marked each one lost (or forgot it): the moment a death is
  "noticed", from which the routers' exclusion is timed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
from psycopg import sql

from localfabric.procs import die_with_parent, fabric_port

DEFAULT_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
START_TIMEOUT_S = 60.0
_counter = 0


def _with_database(server_url: str, database: str) -> str:
    base, _, _ = server_url.rpartition("/")
    return f"{base}/{database}"


@contextlib.contextmanager
def scratch_database(server_url: str = DEFAULT_SERVER_URL) -> Iterator[str]:
    """A fresh database on the server of `server_url` (a libpq URL), dropped afterwards."""
    global _counter
    _counter += 1
    name = f"meridian_scale_{os.getpid()}_{_counter}"
    maintenance = _with_database(server_url, "postgres")
    with psycopg.connect(maintenance, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield _with_database(server_url, name)
    finally:
        with psycopg.connect(maintenance, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far, its threads included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class ServerProc:
    """A `python -m cli ...` server process and the log it writes."""

    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_http(self, path: str, token: str = "", timeout_s: float = START_TIMEOUT_S) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.popen.returncode}): {self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(self.url + path, headers=headers).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not answer {path} in {timeout_s:g} s: {self.tail()}")
                time.sleep(0.2)

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def spawn(name: str, args: list[str], env: dict[str, str], url: str, log_dir: Path) -> ServerProc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    with open(log, "ab") as out:
        popen = subprocess.Popen([sys.executable, "-m", "cli", *args], env=full_env, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent)
    return ServerProc(name, url, popen, log)


def start_control_plane(database_url: str, token: str, log_dir: Path,
                        env: dict[str, str] | None = None) -> ServerProc:
    """The real control plane on `database_url`, its fleet loops off (no provider to drive)."""
    port = fabric_port("127.0.0.1")
    proc = spawn("control-plane", ["control-plane", "serve", "--host", "127.0.0.1", "--port", str(port),
                                   "--database-url", database_url],
                 {"MERIDIAN_CLUSTER_TOKEN": token, "MERIDIAN_CP_RECONCILER_ENABLED": "false",
                  "MERIDIAN_CP_AUTOSCALER_ENABLED": "false", "MERIDIAN_LOG_LEVEL": "WARNING", **(env or {})},
                 f"http://127.0.0.1:{port}", log_dir)
    proc.wait_http("/health")
    return proc


def start_router(number: int, cp_url: str, token: str, log_dir: Path, probes: bool) -> ServerProc:
    """A real router; its active probes are off unless asked (a simulated node has no listener)."""
    port = fabric_port("127.0.0.1")
    proc = spawn(f"router-{number}", ["router", "serve", "--host", "127.0.0.1", "--port", str(port),
                                      "--control-plane-url", cp_url],
                 # One worker: the stack reads one router process's memory and table version.
                 {"MERIDIAN_CLUSTER_TOKEN": token, "MERIDIAN_ROUTER_PROBE_ENABLED": str(probes).lower(),
                  "MERIDIAN_LOG_LEVEL": "WARNING", "MERIDIAN_ROUTER_WORKERS": "1"},
                 f"http://127.0.0.1:{port}", log_dir)
    proc.wait_http("/health")
    return proc


_VERSION_GAUGE = "meridian_router_routing_table_version "


def router_table_version(http: httpx.Client, router: ServerProc, token: str) -> int | None:
    """The table version a real router serves, from its /metrics gauge."""
    r = http.get(router.url + "/metrics", headers={"authorization": f"Bearer {token}"})
    for line in r.text.splitlines():
        if line.startswith(_VERSION_GAUGE):
            return int(float(line[len(_VERSION_GAUGE):]))
    return None


@dataclass(frozen=True, slots=True)
class PgSnapshot:
    at: float
    commits: int
    inserted: int
    updated: int
    deleted: int


class PgCounters:
    """pg_stat_database of one database (the statistics collector flushes about once a second,
    so a window shorter than a few seconds says little)."""

    def __init__(self, database_url: str) -> None:
        self._conn = psycopg.connect(database_url, autocommit=True)
        self._name = database_url.rpartition("/")[2]

    def snapshot(self) -> PgSnapshot:
        row = self._conn.execute(
            "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted FROM pg_stat_database"
            " WHERE datname = %s", (self._name,)).fetchone()
        assert row is not None
        return PgSnapshot(time.monotonic(), *(int(v) for v in row))

    def close(self) -> None:
        self._conn.close()


@dataclass
class LostWatch:
    """Polls the nodes table for the watched nodes; `lost_at[node]` is when it was first seen
    lost (or gone), on the monotonic clock."""

    database_url: str
    every_s: float = 0.02
    watched: set[str] = field(default_factory=set)
    lost_at: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def watch(self, node_id: str) -> None:
        self.watched.add(node_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="lost-watch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            while not self._stop.wait(self.every_s):
                pending = sorted(self.watched - self.lost_at.keys())
                if not pending:
                    continue
                rows = dict(conn.execute("SELECT node_id, status FROM nodes WHERE node_id = ANY(%s)",
                                         (pending,)).fetchall())
                now = time.monotonic()
                for node_id in pending:
                    if rows.get(node_id, "lost") == "lost":
                        self.lost_at[node_id] = now


class BackendCpu:
    """CPU seconds used by the Postgres backends of one database, sampled every `every_s` in a
    thread: backends come and go (the control plane's pool), so each one's last sample counts
    (what a backend spent in its last `every_s` before closing is missed)."""

    def __init__(self, database_url: str, every_s: float = 0.25) -> None:
        self._url, self._every_s = database_url, every_s
        self._name = database_url.rpartition("/")[2]
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pg-backend-cpu")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def total(self) -> float:
        """CPU seconds of the database's backends since sampling began."""
        with self._lock:
            return sum(cpu - self._first[pid] for pid, cpu in self._last.items())

    def _run(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while True:
                rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (self._name,)).fetchall()
                first_round = not self._first
                with self._lock:
                    for (pid,) in rows:
                        with contextlib.suppress(OSError):
                            cpu = cpu_seconds(pid)
                            # A backend that appeared after the first round counts from zero.
                            self._first.setdefault(pid, cpu if first_round else 0.0)
                            self._last[pid] = cpu
                if self._stop.wait(self._every_s):
                    return
