"""The report of one drill run: report.json (for machines), report.md (for people), timeline.png.

Inputs are what the runner already has: the drill it ran (its short version for a short run),
the run's history, the checker's `CheckResult` and `Verdict`, the invariants it observed and
what its fault injector actually did. Every file is written atomically (a temporary file in
the same directory, then `os.replace`), so a reader never sees half a report, even when the
run is killed while writing it.

The PNG needs matplotlib (the `chaos` extra). Without it the PNG is skipped, a note says so
in report.md and report.json, and both are still written.

This module writes the files; what goes into them is in its parts: `inputs` (the run as
the runner hands it in), `series` (the timeline's per-bucket series), `json_model`
(report.json), `markdown` (report.md, summary.md and the CLI's criterion rows), `traffic`
(failovers and traffic shifts between nodes) and `plot` (timeline.png, with `plot_events`
and `plot_nodes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from chaos.history import History
from chaos.report.inputs import ReportFiles, RunReport
from chaos.report.json_model import ReportModel, report_model
from chaos.report.markdown import report_markdown, suite_markdown, summary_rows
from chaos.report.plot import draw_timeline
from chaos.report.series import NO_NODE, NO_REGION, TimelineSeries, timeline_series
from chaos.timeline import FaultEvent
from meridian.atomic_file import write_atomic

NO_MATPLOTLIB = "timeline.png not drawn: matplotlib is not installed (pip install 'meridian[chaos]')"


# A report is for anyone who can read the run's directory, not private like mkstemp's 0600.
REPORT_MODE = 0o644


def write_report(report: RunReport, history: History, out_dir: Path) -> ReportFiles:
    """Write report.json, report.md and timeline.png (when matplotlib is installed) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timeline = timeline_series(history)
    not_checked = list(report.not_checked)
    png_path: Path | None = out_dir / "timeline.png"
    png = draw_timeline(report, timeline)
    if png is None:
        not_checked.append(NO_MATPLOTLIB)
        png_path = None
    else:
        # The PNG first: the markdown links to it, so it should exist by the time the md does.
        write_atomic(out_dir / "timeline.png", png, mode=REPORT_MODE)
    model = report_model(report, timeline, not_checked)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    write_atomic(json_path, (model.model_dump_json(indent=2) + "\n").encode("utf-8"), mode=REPORT_MODE)
    md = report_markdown(report, not_checked, None if png_path is None else png_path.name)
    write_atomic(md_path, md.encode("utf-8"), mode=REPORT_MODE)
    return ReportFiles(report_json=json_path, report_md=md_path, timeline_png=png_path)


def write_suite_summary(reports: Sequence[RunReport], out_dir: Path) -> Path:
    """Write summary.md, one table row per drill run, into out_dir; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.md"
    write_atomic(path, suite_markdown(reports).encode("utf-8"), mode=REPORT_MODE)
    return path


__all__ = [
    "FaultEvent",
    "NO_MATPLOTLIB",
    "NO_NODE",
    "NO_REGION",
    "ReportFiles",
    "ReportModel",
    "RunReport",
    "TimelineSeries",
    "summary_rows",
    "timeline_series",
    "write_report",
    "write_suite_summary",
]
