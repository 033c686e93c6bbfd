"""`meridian chaos list`: every built-in drill in a table; a bad drill file is a one-line error."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from chaos.drill import load_drills
from cli.main import app


def test_chaos_list_shows_every_drill_with_its_fault_and_short_length():
    result = CliRunner().invoke(app, ["chaos", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    drills = load_drills()
    assert f"{len(drills)} drills" in result.output
    for drill in drills:
        assert drill.name in result.output and drill.fault.kind in result.output


def test_a_broken_drill_file_is_named_in_a_one_line_error(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text("name: bad\ndescription: x\nfault: {kind: earthquake}\n")
    result = CliRunner().invoke(app, ["chaos", "list", "--dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "bad.yaml" in result.output and "Traceback" not in result.output


def _deployment_file(tmp_path: Path, **extra: object) -> Path:
    import yaml

    data = {"name": "staging", "control_plane": "http://127.0.0.1:9", "routers": ["http://127.0.0.1:9"],
            "model": "m", "admin_key_env": "STAGING_ADMIN_KEY", "journals": [{"name": "j", "path": "/nowhere/*"}],
            "actions": {"process_hang": {"type": "command", "inject": "true"}}} | extra
    path = tmp_path / "staging.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_deployment_without_its_admin_key_is_a_one_line_error(tmp_path: Path):
    result = CliRunner().invoke(app, ["chaos", "run", "gray-failure", "--deployment", str(_deployment_file(tmp_path)),
                                      "--out", str(tmp_path / "out")], env={"STAGING_ADMIN_KEY": ""})
    assert result.exit_code == 2, result.output
    assert "set STAGING_ADMIN_KEY" in result.output and "Traceback" not in result.output


def test_a_drill_the_deployment_has_no_action_for_is_not_run_and_fails_the_suite(tmp_path: Path):
    result = CliRunner().invoke(app, ["chaos", "run", "redis-down", "--deployment", str(_deployment_file(tmp_path)),
                                      "--out", str(tmp_path / "out")], env={"STAGING_ADMIN_KEY": "mk-x", "COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "NOT RUN" in result.output and "no action for fault kind redis_outage" in result.output
