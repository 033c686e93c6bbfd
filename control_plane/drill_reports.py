"""Chaos drill reports on disk, read for the web console: DIR/<name>/report.json and timeline.png.

`meridian chaos run --out DIR` writes one directory per drill; the control plane only reads
them (MERIDIAN_CP_DRILL_REPORTS_DIR). A name from a URL never becomes a path by itself: it
must match NAME_PATTERN (no separator, no leading dot, so neither `..` nor an absolute path)
and name a real directory directly under DIR, not a symbolic link, whose files are regular
files, not links either; so no request reads anything outside DIR.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from meridian.admin_api import DrillReportSummary

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
REPORT_JSON = "report.json"
TIMELINE_PNG = "timeline.png"
# Reports are a few hundred kB at most; a bigger file is not one of ours.
MAX_JSON_BYTES = 8 << 20
MAX_PNG_BYTES = 16 << 20
# Listed, newest first.
MAX_LISTED = 50


class ReportNotFound(LookupError):
    """No such report (or the file is not a plain file under the reports directory)."""


def _regular_file(directory: Path, name: str, max_bytes: int) -> Path | None:
    path = directory / name
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        return None
    return path


def _report_dir(base: Path, name: str) -> Path:
    """The report directory `name` directly under `base` (ReportNotFound if it is not one)."""
    if not name or name.startswith(".") or "/" in name or "\\" in name or "\x00" in name:
        raise ReportNotFound(name)
    directory = base / name
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise ReportNotFound(name) from e
    if not stat.S_ISDIR(st.st_mode) or directory.resolve().parent != base.resolve():
        raise ReportNotFound(name)
    return directory


def read_report(base: Path, name: str) -> dict[str, Any]:
    """report.json of report `name`, parsed (a JSON object)."""
    path = _regular_file(_report_dir(base, name), REPORT_JSON, MAX_JSON_BYTES)
    if path is None:
        raise ReportNotFound(name)
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ReportNotFound(name) from e
    if not isinstance(data, dict):
        raise ReportNotFound(name)
    return data


def read_timeline_png(base: Path, name: str) -> bytes:
    path = _regular_file(_report_dir(base, name), TIMELINE_PNG, MAX_PNG_BYTES)
    if path is None:
        raise ReportNotFound(name)
    try:
        return path.read_bytes()
    except OSError as e:
        raise ReportNotFound(name) from e


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _summary(base: Path, name: str) -> DrillReportSummary | None:
    try:
        data = read_report(base, name)
    except ReportNotFound:
        return None
    fault = data.get("fault")
    return DrillReportSummary(
        name=name,
        drill=str(data.get("drill") or name),
        started_at=_text(data.get("started_at")),
        duration_s=_number(data.get("duration_s")),
        passed=data.get("passed") if isinstance(data.get("passed"), bool) else None,
        fault=_text(fault.get("kind")) if isinstance(fault, dict) else None,
        recovery_s=_number(data.get("recovery_s")),
        timeline_png=_regular_file(base / name, TIMELINE_PNG, MAX_PNG_BYTES) is not None,
    )


def list_reports(base: Path | None) -> list[DrillReportSummary]:
    """The reports under `base`, newest first (by started_at, then name); [] without a directory."""
    if base is None:
        return []
    try:
        entries = [e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    found = [s for s in (_summary(base, n) for n in sorted(entries) if not n.startswith(".")) if s is not None]
    found.sort(key=lambda s: (s.started_at or "", s.name), reverse=True)
    return found[:MAX_LISTED]
