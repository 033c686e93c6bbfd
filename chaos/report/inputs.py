"""What the runner hands the report: the run (RunReport) and, back, the files written."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from chaos.checker import CheckResult, Verdict
from chaos.drill import Drill
from chaos.timeline import FaultEvent


@dataclass(frozen=True)
class RunReport:
    """Everything known about one run of a drill; `drill` is the version that ran (short or full)."""

    drill: Drill
    short: bool
    started_at: datetime  # wall clock, UTC
    duration_s: float
    fault_start_s: float  # actual
    fault_end_s: float
    events: tuple[FaultEvent, ...]
    result: CheckResult
    verdict: Verdict
    invariants: Mapping[str, bool]
    aborted: str | None = None  # why the run was aborted, when it was
    not_checked: tuple[str, ...] = ()  # notes on what could not be observed (with reasons)

    @property
    def passed(self) -> bool:
        """The run passes when every criterion does and it was not aborted."""
        return self.verdict.passed and self.aborted is None


@dataclass(frozen=True)
class ReportFiles:
    """Paths of the files write_report wrote; `timeline_png` is None when it could not be drawn."""

    report_json: Path
    report_md: Path
    timeline_png: Path | None


def utc_iso(t: datetime) -> str:
    """The time in ISO 8601, UTC; a naive time is taken to be UTC already, as RunReport documents."""
    t = t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    return t.isoformat()


def verdict_word(passed: bool) -> str:
    return "PASS" if passed else "FAIL"
