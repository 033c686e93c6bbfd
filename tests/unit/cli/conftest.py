"""A real control plane for the CLI's admin commands: `serve` in a process of its own on a free
port (SQLite), started once per module, which the commands reach over HTTP as an operator's would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cp_harness import ADMIN_KEY, spawn_control_plane, stop_process, wait_until_up

from meridian.ports import free_port


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a running control plane whose bootstrap admin key is cp_harness.ADMIN_KEY."""
    db = Path(tmp_path_factory.mktemp("cp")) / "cp.db"
    port = free_port()
    proc = spawn_control_plane(port, f"sqlite:///{db}", MERIDIAN_CP_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY)
    try:
        wait_until_up(proc, port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture
def admin_env(control_plane: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment that points the CLI at the control plane with the admin key."""
    monkeypatch.delenv("MERIDIAN_API_KEY", raising=False)
    monkeypatch.delenv("MERIDIAN_CONTROL_PLANE_URL", raising=False)
    return {"MERIDIAN_CONTROL_PLANE_URL": control_plane, "MERIDIAN_API_KEY": ADMIN_KEY, "COLUMNS": "200"}
