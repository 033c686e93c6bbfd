"""`serve` runs the control plane under uvicorn and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from alembic.script import ScriptDirectory

from control_plane.db import migrate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_serve_migrates_answers_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = _free_port()
    db_url = f"sqlite:///{tmp_path / 'cp.db'}"
    env = {
        **os.environ,
        "MERIDIAN_CP_DATABASE_URL": db_url,
        "MERIDIAN_CP_PORT": str(port),
        "MERIDIAN_CLUSTER_TOKEN": "t",
    }
    code = "from control_plane.app import serve; from meridian.settings import ControlPlaneSettings; serve(ControlPlaneSettings())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "control plane did not come up"
            time.sleep(0.1)
        r = httpx.get(
            f"http://127.0.0.1:{port}/v1/routing-table", headers={"authorization": "Bearer t"}, timeout=2
        )
        assert r.status_code == 200
        assert r.headers["etag"] == '"0"'
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Migrated to the newest revision, whichever that is.
    assert migrate.current(db_url) == ScriptDirectory.from_config(migrate.alembic_config(db_url)).get_current_head()
