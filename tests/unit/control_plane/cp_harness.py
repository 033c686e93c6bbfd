"""Client-side helpers for the control-plane tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from control_plane.errors import PROBLEM_MEDIA_TYPE
from meridian.clock import ManualClock
from meridian.settings.control_plane import ControlPlaneSettings

CLUSTER_TOKEN = "test-cluster-token"
ADMIN_KEY = "mrd_bootstrap-admin-key-for-tests"
# The instance id a spawned control plane reports on /health (as a local fabric's does).
INSTANCE_ID = "cp-tests"


@dataclass
class ControlPlane:
    app: FastAPI
    http: httpx.AsyncClient
    settings: ControlPlaneSettings

    internal = {"authorization": f"Bearer {CLUSTER_TOKEN}"}
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}

    @staticmethod
    def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
        """The response is an RFC 9457 problem with this status; returns its body."""
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith(PROBLEM_MEDIA_TYPE)
        body: dict[str, Any] = response.json()
        assert body["status"] == status
        assert body["title"]
        assert "Traceback" not in response.text
        return body

    async def admin_list(self, path: str, **params: str) -> list[dict[str, Any]]:
        """One page of an admin listing, as the API orders it (the listing must answer 200)."""
        r = await self.http.get(path, params=params, headers=self.admin)
        assert r.status_code == 200, r.text
        body: list[dict[str, Any]] = r.json()
        return body

    async def register(self, node_id: str, region: str = "aws:us-east-1", **fields: Any) -> httpx.Response:
        body = {
            "node_id": node_id,
            "region": region,
            "url": f"http://{node_id}.test:8000",
            "models": ["tiny-llama"],
            **fields,
        }
        return await self.http.post("/v1/nodes/register", json=body, headers=self.internal)

    async def heartbeat(self, node_id: str, **fields: Any) -> httpx.Response:
        body = {"status": "ready", **fields}
        return await self.http.post(f"/v1/nodes/{node_id}/heartbeat", json=body, headers=self.internal)

    async def table(self, **headers: str) -> httpx.Response:
        return await self.http.get("/v1/routing-table", headers={**self.internal, **headers})

    async def version(self) -> int:
        r = await self.table()
        assert r.status_code == 200
        version: int = r.json()["version"]
        return version

    async def create_key(self, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
        # The tenant is made with its first key: the tests are about keys, not tenants.
        body = {"name": "k", "tenant": "acme", "zone": "eu", "scopes": ["inference"], "create_tenant": True, **fields}
        return await self.http.post("/v1/api-keys", json=body, headers=headers or self.admin)


# --- driving an app that runs on a ManualClock --------------------------------------------

# The fleet loops off: the reaper is then the one loop of the app's own on its clock.
LOOPS_OFF: dict[str, Any] = {"reconciler_enabled": False, "autoscaler_enabled": False}
REAPER = 1
# A test that runs its control plane on a ManualClock (and the fleet loops off).
on_manual_clock = pytest.mark.parametrize(
    ("clock_kind", "settings_overrides"), [("manual", LOOPS_OFF)], ids=["manual-clock"]
)



async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Let the event loop and the worker threads (database calls) run until `predicate()` holds.

    Nothing here waits for time to pass: the test moves the ManualClock; the real-time bound
    only turns a hang into a failure.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


async def advance(clock: ManualClock, seconds: float, *, sleepers: int) -> None:
    """Move `clock` on by `seconds`, then wait until the app's `sleepers` loops sleep on it
    again, i.e. every loop it woke has finished its pass."""
    clock.advance(seconds)
    await until(lambda: clock.sleepers >= sleepers)


async def advance_until(
    clock: ManualClock, predicate: Callable[[], bool], *, step_s: float, sleepers: int, within_s: float
) -> None:
    """`advance` by `step_s` until `predicate()` holds, failing after `within_s` of the clock's time."""
    started = clock.monotonic()
    while not predicate():
        assert clock.monotonic() - started < within_s, f"condition not met within {within_s:g}s"
        await advance(clock, step_s, sleepers=sleepers)


# --- control planes as real processes (`serve`, as `meridian control-plane serve` runs it) ---

_SERVE = (
    "from control_plane.app import serve; from meridian.settings.control_plane import ControlPlaneSettings; "
    "serve(ControlPlaneSettings())"
)


def spawn_control_plane(port: int, database_url: str, **env: str) -> subprocess.Popen[bytes]:
    """Start `serve` in a process of its own on 127.0.0.1:`port`; `env` adds MERIDIAN_* variables."""
    environ = {
        **os.environ,
        "MERIDIAN_CP_DATABASE_URL": database_url,
        "MERIDIAN_CP_PORT": str(port),
        "MERIDIAN_CLUSTER_TOKEN": CLUSTER_TOKEN,
        "MERIDIAN_CP_INSTANCE_ID": INSTANCE_ID,
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-c", _SERVE], env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def poll(check: Callable[[], bool], timeout_s: float, message: str, interval_s: float = 0.1) -> None:
    """Call `check` until it returns True: the state of real processes, which run on real
    time (`check` may raise to fail at once)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, message
        time.sleep(interval_s)


def wait_until_up(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 20) -> None:
    """Wait for /health to answer 200; fails with the process's output if it exits first."""

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode() if proc.stdout else f"exited {proc.returncode}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    poll(up, timeout_s, "control plane did not come up")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Kill the process if it still runs and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
