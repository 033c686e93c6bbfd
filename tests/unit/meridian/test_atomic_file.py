"""write_atomic: the whole new file or the old one, never a part, and no temporary left behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meridian.atomic_file import write_atomic


def test_replaces_the_file_private_unless_a_mode_is_given(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_bytes(b"old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_atomic(path, b"newer", mode=0o644)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]


def test_a_failed_rename_keeps_the_old_file_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "table.json"
    path.write_bytes(b"old")

    def fail(src: str, dst: str) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk went away"):
        write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]
