"""Faults on the weight path of a node joining the fabric mid-drill: a corrupted chunk at
the origin, and a disk that is full when the node fetches the model.

Both start a new node in the target region (a fresh cache, as a new instance has) while the
load runs on the others, and watch it: it must refuse to serve what it could not verify or
store, say why, keep its cache consistent, and come up once the fault is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from chaos.drill import Fault
from chaos.environment import COLD_START_NICENESS, DrillEnvironment, InjectionError
from chaos.history import History, Served
from localfabric import Proc, renice
from meridian.admin_client import AdminAPIError, AsyncAdminClient
from meridian.contracts import NodeStatus

_MANIFEST = "meridian-manifest.json"
_WATCH_INTERVAL_S = 0.25
# How long a node that cannot load may take to say so and exit.
_FAIL_TIMEOUT_S = 90.0
_READY_TIMEOUT_S = 120.0


class _JoiningNode:
    """A node started mid-drill and what was seen of it: READY, exit code, served requests."""

    def __init__(self, env: DrillEnvironment, fault: Fault, extra_env: dict[str, str] | None = None) -> None:
        self.env = env
        self.region = fault.target.region or ""
        if not self.region:
            raise InjectionError(f"{fault.kind} needs target.region (where the new node starts)")
        self.node_id = env.fabric.new_node_id(self.region)
        self.extra_env = extra_env or {}
        self.proc: Proc | None = None
        self.ready_while_faulty = False
        self.exit_code: int | None = None
        self._watch: asyncio.Task[None] | None = None
        self._faulty = True

    @property
    def cache_dir(self) -> Path:
        return self.env.fabric.node_cache_dir(self.node_id)

    async def start(self) -> None:
        self.proc = await asyncio.to_thread(
            self.env.fabric.start_replacement_node, self.region, COLD_START_NICENESS, self.node_id, self.extra_env)
        self.env.event("start", f"{self.node_id} joins {self.region} (pid {self.proc.popen.pid})")
        self._watch = asyncio.create_task(self._watch_ready(), name=f"watch-{self.node_id}")

    async def _watch_ready(self) -> None:
        """Until the fault is healed: was the node ever READY in the control plane?"""
        info = self.env.info
        async with AsyncAdminClient(info.control_plane_url, info.admin_key, timeout_s=2.0) as admin:
            while self._faulty:
                try:
                    nodes = await admin.nodes()
                    if any(n.node_id == self.node_id and n.status == NodeStatus.READY for n in nodes):
                        self.ready_while_faulty = True
                        self.env.event("ready", f"{self.node_id} is READY while the fault is on")
                        return
                except AdminAPIError:
                    pass
                await asyncio.sleep(_WATCH_INTERVAL_S)

    async def wait_exit(self, timeout_s: float = _FAIL_TIMEOUT_S) -> int | None:
        """The node's exit code once it gave up loading; None when it is still running."""
        assert self.proc is not None
        proc = self.proc
        try:
            self.exit_code = await asyncio.wait_for(asyncio.to_thread(proc.popen.wait), timeout_s)
        except TimeoutError:
            return None
        self.env.event("exited", f"{self.node_id} exited with code {self.exit_code}")
        return self.exit_code

    def log_tail(self, limit: int = 20_000) -> str:
        if self.proc is None or not self.proc.log.exists():
            return ""
        return self.proc.log.read_text(errors="replace")[-limit:]

    async def fault_removed(self) -> None:
        """Stop watching for READY: from now on the node may (and should) come up."""
        self._faulty = False
        if self._watch is not None:
            self._watch.cancel()

    async def restart_and_wait_ready(self) -> bool:
        """Start the node again, as its supervisor would, and wait until it is READY."""
        assert self.proc is not None
        if self.proc.popen.poll() is None:
            await self.env.signal([self.proc], signal.SIGKILL, reap=True)
        self.proc = self.env.fabric.restart(self.proc, niceness=COLD_START_NICENESS)
        self.env.event("restart", f"{self.node_id} started again (pid {self.proc.popen.pid})")
        try:
            await asyncio.to_thread(self.env.fabric.wait_ready, self.proc, _READY_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - reported as the invariant failing, with why
            self.env.event("not ready", f"{self.node_id} did not become READY: {exc}")
            return False
        renice(self.proc.popen.pid, 0)
        self.env.event("ready", f"{self.node_id} is READY")
        return True

    def served_keys(self, history: History) -> list[str]:
        return [r.key for r in history.served if isinstance(r, Served) and r.node == self.node_id]


def cache_consistent(cache_dir: Path) -> tuple[bool, str]:
    """Every published blob hashes to its name and every model file links to a published blob:
    nothing partial is where a reader looks."""
    blobs = cache_dir / "blobs"
    bad: list[str] = []
    for blob in sorted(blobs.iterdir()) if blobs.exists() else []:
        h = hashlib.sha256()
        with open(blob, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != blob.name:
            bad.append(f"blobs/{blob.name[:12]}… does not hash to its name")
    models = cache_dir / "models"
    for model in sorted(models.iterdir()) if models.exists() else []:
        manifest = model / _MANIFEST
        if not manifest.exists():
            bad.append(f"models/{model.name[:12]}… has no manifest")
            continue
        for entry in json.loads(manifest.read_text())["files"]:
            if not (blobs / entry["sha256"]).exists():
                bad.append(f"models/{model.name[:12]}…/{entry['path']} has no published blob")
    return not bad, "; ".join(bad) or "every blob verified"


def _weights_file(origin: Path) -> tuple[dict[str, object], Path]:
    """The biggest file of the model at the origin (the weights) and its manifest entry."""
    manifest = json.loads((origin / _MANIFEST).read_text())
    entry = max(manifest["files"], key=lambda f: f["size"])
    return entry, origin / str(entry["path"])


class CorruptWeightChunk:
    """Flip bytes in one chunk of the model's weights at the origin, then start a node with
    an empty cache and no peers to fetch from: it must fetch from the corrupted origin."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._chunk = int(fault.params.get("chunk_index", 0))
        # No same-region peer may hand it good bytes: the origin is all it has.
        self._node = _JoiningNode(env, fault, {"MERIDIAN_WEIGHTS_PEER_FETCH": "false"})
        self._original: bytes | None = None
        self._path: Path | None = None
        self._offset = 0

    async def inject(self) -> None:
        entry, path = _weights_file(self._env.fabric.origin_dir)
        chunk_size, size = int(str(entry["chunk_size"])), int(str(entry["size"]))
        start = self._chunk * chunk_size
        if start >= size:
            raise InjectionError(f"{path.name} has no chunk {self._chunk} ({size} bytes, chunks of {chunk_size})")
        # The middle of the chunk: past a safetensors header, inside the tensors.
        self._path, self._offset = path, start + (min(size, start + chunk_size) - start) // 2
        self._original = await asyncio.to_thread(_flip_bytes, path, self._offset, 64)
        self._env.event("inject", f"flipped {len(self._original)} bytes of chunk {self._chunk} of {path.name} "
                                  f"at offset {self._offset}")
        await self._node.start()
        await self._node.wait_exit()

    async def heal(self) -> None:
        if self._path is not None and self._original is not None:
            await asyncio.to_thread(_write_at, self._path, self._offset, self._original)
            self._env.event("heal", f"chunk {self._chunk} of {self._path.name} restored")
        await self._node.fault_removed()
        if self._node.proc is not None:
            # Started again by its supervisor, it fetches verified bytes and comes up (shown in
            # the events; the drill's load may end first).
            await self._node.restart_and_wait_ready()

    async def observe(self, history: History) -> Mapping[str, bool]:
        log = self._node.log_tail()
        detected = (self._node.exit_code not in (None, 0)) and "does not match its sha256" in log
        consistent, _ = cache_consistent(self._node.cache_dir)
        never_served = not self._node.ready_while_faulty and consistent
        return {"corruption_detected_by_digest": detected, "corrupt_model_never_served": never_served,
                "cache_consistent": consistent}


class DiskFullDuringFetch:
    """The new node's cache lives on a small tmpfs that a filler file leaves `free_bytes` of;
    healing deletes the filler (space freed) and the node is started again."""

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "mounting a size-limited tmpfs for the node's cache needs root"
        return None

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._free = int(fault.params.get("free_bytes", 0))
        self._node = _JoiningNode(env, fault)
        self._filler: Path | None = None
        self._recovered = False

    async def inject(self) -> None:
        origin = self._env.fabric.origin_dir
        model_bytes = sum(int(f["size"]) for f in json.loads((origin / _MANIFEST).read_text())["files"])
        mount = self._node.cache_dir
        mount.mkdir(parents=True, exist_ok=True)
        # Room for the model twice over (a download and its published copy, plus the cache's
        # journal and locks), so only the filler makes the disk full.
        size = model_bytes * 2 + (4 << 20)
        result = await asyncio.to_thread(subprocess.run, ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                                          str(mount)], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise InjectionError(f"mounting a tmpfs at {mount} failed: {result.stderr.strip()}")
        self._env.cleanups.append(lambda: subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30))
        self._filler = mount / "filler"
        left = await asyncio.to_thread(_fill, self._filler, self._free)
        self._env.event("inject", f"{self._node.node_id}'s cache disk has {left} bytes free "
                                  f"(the model needs {model_bytes})")
        await self._node.start()
        await self._node.wait_exit()

    async def heal(self) -> None:
        if self._filler is not None:
            self._filler.unlink(missing_ok=True)
            self._env.event("heal", f"space freed on {self._node.node_id}'s cache disk")
        await self._node.fault_removed()
        if self._node.proc is not None:
            self._recovered = await self._node.restart_and_wait_ready()

    async def observe(self, history: History) -> Mapping[str, bool]:
        # The node says what is wrong, in words an operator acts on, and exits for its supervisor.
        clear = self._node.exit_code not in (None, 0) and "CacheFullError" in self._node.log_tail()
        consistent, _ = cache_consistent(self._node.cache_dir)
        return {"clear_disk_full_error": clear, "cache_consistent": consistent,
                "node_recovers_after_space_freed": self._recovered}


def _flip_bytes(path: Path, offset: int, n: int) -> bytes:
    """Invert `n` bytes of a file in place; returns the original bytes."""
    with open(path, "r+b") as f:
        f.seek(offset)
        original = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in original))
    return original


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(filler: Path, leave_free: int) -> int:
    """Write `filler` until its file system has at most `leave_free` bytes free; returns what is free."""
    remaining = max(0, _free_bytes(filler.parent) - leave_free)
    with open(filler, "wb") as f:
        while remaining > 0:
            n = min(remaining, 1 << 20)
            try:
                f.write(b"\0" * n)
                f.flush()
            except OSError:  # full a little early (metadata): that is the point
                break
            remaining -= n
    return _free_bytes(filler.parent)
