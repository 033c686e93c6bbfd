"""With no key given, the admin commands use the local demo's fabric.json (key and URL), say so
on stderr, never send its key to another control plane, and ignore a file others can read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cp_harness import ADMIN_KEY
from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


@pytest.fixture
def no_key_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("MERIDIAN_API_KEY", "MERIDIAN_CONTROL_PLANE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_state(root: Path, control_plane: str, mode: int = 0o600, work_dir: str = ".meridian/demo") -> Path:
    path = root / work_dir / "fabric.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"router_url": "http://127.0.0.1:1", "control_plane_url": control_plane,
                                "admin_key": ADMIN_KEY, "keys": {}, "pids": {}}))
    os.chmod(path, mode)
    return path


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
    r = runner.invoke(app, ["status", "--control-plane", "http://127.0.0.1:1/"])
    assert r.exit_code == 1 and "unreachable" in r.stderr and "using the demo's admin key" in r.stderr


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
