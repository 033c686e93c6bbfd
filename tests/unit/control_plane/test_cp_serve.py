"""`serve` runs the control plane under uvicorn and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
from alembic.script import ScriptDirectory
from cp_harness import CLUSTER_TOKEN, spawn_control_plane, stop_process, wait_until_up

from control_plane.db import migrate
from meridian.ports import free_port


def test_serve_migrates_answers_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'cp.db'}"
    proc = spawn_control_plane(port, db_url)
    try:
        wait_until_up(proc, port)
        r = httpx.get(
            f"http://127.0.0.1:{port}/v1/routing-table",
            headers={"authorization": f"Bearer {CLUSTER_TOKEN}"},
            timeout=2,
        )
        assert r.status_code == 200
        assert r.headers["etag"] == '"0"'
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        stop_process(proc)
    # Migrated to the newest revision, whichever that is.
    assert migrate.current(db_url) == ScriptDirectory.from_config(migrate.alembic_config(db_url)).get_current_head()
