"""With no key given, the admin commands use the local demo's fabric.json (key and URL), say so
on stderr, never send its key to another control plane, ignore a file others can read, and
call a file stale when the demo it describes is gone (its processes exited, or another
control plane answers on its port)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cp_harness import ADMIN_KEY, INSTANCE_ID
from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


@pytest.fixture
def no_key_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("MERIDIAN_API_KEY", "MERIDIAN_CONTROL_PLANE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_state(root: Path, control_plane: str, mode: int = 0o600, work_dir: str = ".meridian/demo",
                pids: dict[str, int] | None = None, instance_id: str = INSTANCE_ID) -> Path:
    """A fabric.json as the local fabric writes it: by default, of a demo whose processes (this
    test's) run and whose control plane is `control_plane`."""
    path = root / work_dir / "fabric.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"router_url": "http://127.0.0.1:1", "control_plane_url": control_plane,
                                "control_plane_instance_id": instance_id, "admin_key": ADMIN_KEY, "keys": {},
                                "pids": {"control-plane": os.getpid()} if pids is None else pids}))
    os.chmod(path, mode)
    return path


def exited_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_status_finds_the_demos_key_and_control_plane(no_key_env, control_plane):
    write_state(no_key_env, control_plane)
    r = runner.invoke(app, ["status", "-o", "json"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["regions"]  # stdout is the JSON alone
    assert "using the demo's admin key" in r.stderr and control_plane in r.stderr
    assert ADMIN_KEY not in r.output


def test_the_vllm_demos_state_is_found_too(no_key_env, control_plane):
    write_state(no_key_env, control_plane, work_dir=".meridian/demo-vllm")
    r = runner.invoke(app, ["tenants", "list"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output


def test_the_demo_key_goes_only_to_the_demos_control_plane(no_key_env, control_plane):
    write_state(no_key_env, "http://127.0.0.1:1")
    r = runner.invoke(app, ["status", "--control-plane", control_plane])
    assert r.exit_code == 2 and "an API key is needed" in r.stderr
    r = runner.invoke(app, ["status", "--control-plane", "http://127.0.0.1:1/"], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "using the demo's admin key" not in r.stderr
    assert r.stderr.startswith("the demo at http://127.0.0.1:1 is not running (stale ")


def test_a_state_file_others_can_read_is_ignored(no_key_env, control_plane):
    path = write_state(no_key_env, control_plane, mode=0o644)
    r = runner.invoke(app, ["status"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"ignoring {Path('.meridian/demo/fabric.json')}: others can read it" in r.stderr
    assert "an API key is needed" in r.stderr
    path.chmod(0o600)
    assert runner.invoke(app, ["status"]).exit_code == 0


def test_a_broken_state_file_is_ignored_with_a_warning(no_key_env):
    path = no_key_env / ".meridian/demo/fabric.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    path.chmod(0o600)
    r = runner.invoke(app, ["keys", "list"])
    assert r.exit_code == 2 and "ignoring" in r.stderr and "Traceback" not in r.output


def test_a_given_key_wins_over_the_demos(no_key_env, control_plane):
    write_state(no_key_env, control_plane)
    r = runner.invoke(app, ["status", "--api-key", "mrd_wrong", "--control-plane", control_plane])
    assert r.exit_code == 1 and r.stderr.startswith("401") and "demo" not in r.stderr


def test_a_demo_whose_processes_exited_is_stale_though_a_control_plane_answers_its_port(no_key_env, control_plane):
    # The demo is gone; another control plane (this test's) now listens on the port it recorded.
    write_state(no_key_env, control_plane, pids={"control-plane": exited_pid(), "router": exited_pid()})
    r = runner.invoke(app, ["status"], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and r.stdout == "" and "Traceback" not in r.output
    assert r.stderr.strip() == (
        f"the demo at {control_plane} is not running (stale {Path('.meridian/demo/fabric.json')}: its processes "
        "have exited); start it with `make demo` or give --control-plane")


def test_a_demo_whose_port_another_control_plane_answers_is_stale(no_key_env, control_plane):
    write_state(no_key_env, control_plane, instance_id="fabric-0123456789abcdef")
    r = runner.invoke(app, ["tenants", "list"], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and r.stdout == ""
    assert f"the demo at {control_plane} is not running" in r.stderr
    assert "another control plane answers on its port now" in r.stderr


def test_a_stale_demo_does_not_hide_a_running_one(no_key_env, control_plane):
    write_state(no_key_env, control_plane, pids={"control-plane": exited_pid()})
    write_state(no_key_env, control_plane, work_dir=".meridian/demo-vllm")
    r = runner.invoke(app, ["tenants", "list", "-o", "json"])
    assert r.exit_code == 0, r.output
    assert "demo-vllm" in r.stderr
