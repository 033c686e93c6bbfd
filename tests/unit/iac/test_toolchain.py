"""`meridian iac` checks its toolchain before any work: the cdktf packages (the `iac` extra,
absent from `make demo`'s venv) and Node.js on PATH, recent enough for jsii. Each missing piece
is one line naming what to install, exit 2, and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from iac_plans import plan_dict
from typer.testing import CliRunner

from iac.cli import app as iac_app
from iac.toolchain import IAC_MODULES, MIN_NODE_MAJOR, check_toolchain

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[3]


def _plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_dict()))
    return path


def _fake_node(bin_dir: Path, version: str) -> None:
    """A `node` that reports `version`, as an old Node.js install does."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    node = bin_dir / "node"
    node.write_text(f"#!/bin/sh\necho {version}\n")
    node.chmod(0o755)


def test_this_machine_has_the_toolchain():
    # The synth tests need both; a machine without them would fail those, not skip them.
    check_toolchain()


def test_synth_without_node_on_path_is_one_line_with_how_to_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    env["PATH"] = str(tmp_path / "empty-bin")  # no node anywhere on it
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "cli", "iac", "synth", "--plan", str(_plan(tmp_path)), "--out", str(out)],
        capture_output=True, text=True, env={**env, "COLUMNS": "80"}, cwd=ROOT, timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Node.js" in lines[0] and "nodejs.org" in lines[0] and "Errno" not in lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert not out.exists()


def test_diff_with_a_too_old_node_names_the_version(tmp_path, monkeypatch):
    _fake_node(tmp_path / "bin", "v16.20.2")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    plan = _plan(tmp_path)
    result = runner.invoke(iac_app, ["diff", "--old", str(plan), "--new", str(plan)])
    assert result.exit_code == 2
    assert f"Node.js {MIN_NODE_MAJOR} or newer" in result.output and "version 16" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_a_recent_node_passes(tmp_path, monkeypatch):
    _fake_node(tmp_path / "bin", f"v{MIN_NODE_MAJOR + 4}.1.0")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    check_toolchain()


@pytest.mark.parametrize("module", [IAC_MODULES[0], IAC_MODULES[-1]])
def test_synth_without_the_iac_extra_says_which_pip_install(tmp_path, monkeypatch, module):
    # A None entry in sys.modules is how Python marks a module as not importable.
    monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "out"
    result = runner.invoke(iac_app, ["synth", "--plan", str(_plan(tmp_path)), "--out", str(out)])
    assert result.exit_code == 2
    assert "pip install -e '.[iac]'" in result.output and module in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not out.exists()
