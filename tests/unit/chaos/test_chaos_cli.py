"""`meridian chaos list`: every built-in drill in a table; a bad drill file is a one-line error."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from chaos.drill import load_drills
from meridian.cli.main import app


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
