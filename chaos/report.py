"""The report of one drill run: report.json (for machines), report.md (for people), timeline.png.

Inputs are what the runner already has: the drill it ran (its short version for a short run),
the run's history, the checker's `CheckResult` and `Verdict`, the invariants it observed and
what its fault injector actually did. Every file is written atomically (a temporary file in
the same directory, then `os.replace`), so a reader never sees half a report, even when the
run is killed while writing it.

The PNG needs matplotlib (the `chaos` extra). Without it the PNG is skipped, a note says so
in report.md and report.json, and both are still written.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from chaos.checker import CheckResult, CriterionResult, Verdict, join_client, latency_ms, percentile
from chaos.drill import Drill
from chaos.history import History, Outcome

REPORT_VERSION = 1
NO_REGION = "none"  # the timeline's region for requests answered without x-meridian-region
MAX_EXAMPLES = 20  # offending keys listed per count in report.json
MD_EXAMPLES = 5  # and in report.md, where a person reads them
NO_MATPLOTLIB = "timeline.png not drawn: matplotlib is not installed (pip install 'meridian[chaos]')"


# --- what the runner hands in -----------------------------------------------------------


@dataclass(frozen=True)
class FaultEvent:
    """What the injector actually did, in seconds from the start of the load."""

    at_s: float
    action: str  # e.g. "inject", "heal", "abort"
    detail: str  # e.g. "SIGKILL node-aws-us-east-1-2 (pid 1234)"


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


@dataclass(frozen=True)
class Timeline:
    """Per-bucket series of a run, buckets by invoke time starting at `starts_s[i]`.

    `requests_per_s` and `errors_per_s` map a region (the client's x-meridian-region, or
    NO_REGION) to one rate per bucket; an error is any request that did not end `ok`
    (failed, indeterminate, or never answered). `p99_ms` is the nearest-rank p99 latency
    of the `ok` requests invoked in the bucket, None when there were none.
    """

    bucket_s: float
    starts_s: tuple[float, ...]
    regions: tuple[str, ...]
    requests_per_s: Mapping[str, tuple[float, ...]]
    errors_per_s: Mapping[str, tuple[float, ...]]
    p99_ms: tuple[float | None, ...]


# --- the series ---------------------------------------------------------------------------


def timeline_series(history: History, bucket_s: float = 1.0) -> Timeline:
    """Requests/s and errors/s per region and the p99 latency (ms) of ok requests, per bucket."""
    if not bucket_s > 0:
        raise ValueError(f"bucket_s must be positive, got {bucket_s}")
    ops = list(join_client(history.client).values())
    if not ops:
        return Timeline(bucket_s, (), (), {}, {}, ())
    # Buckets start at the load start (0) so series of different runs line up.
    first = min(0, math.floor(min(o.invoke_s for o in ops) / bucket_s))
    last = math.floor(max(o.invoke_s for o in ops) / bucket_s)
    n = last - first + 1
    requests: dict[str, list[int]] = {}
    errors: dict[str, list[int]] = {}
    latencies: list[list[float]] = [[] for _ in range(n)]
    for op in ops:
        i = math.floor(op.invoke_s / bucket_s) - first
        region = op.region or NO_REGION
        if region not in requests:
            requests[region], errors[region] = [0] * n, [0] * n
        requests[region][i] += 1
        if op.outcome is Outcome.OK:
            lat = latency_ms(op)
            if lat is not None:
                latencies[i].append(lat)
        else:
            errors[region][i] += 1
    regions = tuple(sorted(requests, key=lambda r: (r == NO_REGION, r)))
    return Timeline(
        bucket_s=bucket_s,
        starts_s=tuple((first + i) * bucket_s for i in range(n)),
        regions=regions,
        requests_per_s={r: tuple(c / bucket_s for c in requests[r]) for r in regions},
        errors_per_s={r: tuple(c / bucket_s for c in errors[r]) for r in regions},
        p99_ms=tuple(percentile(lat, 99) for lat in latencies),
    )


# --- the JSON boundary --------------------------------------------------------------------


class _Model(BaseModel):
    # Infinity (a request that never ended has an infinite latency) is written as the string
    # "Infinity": strict JSON has no such number and null would read as "nothing measured".
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


class EventModel(_Model):
    at_s: float
    action: str
    detail: str


class FaultModel(_Model):
    kind: str
    target: dict[str, str]
    params: dict[str, float | int | str | bool]
    planned_start_s: float
    planned_end_s: float
    start_s: float
    end_s: float


class CountsModel(_Model):
    attempts: int
    acknowledged: int
    ok: int
    lost: int
    duplicated: int
    unexpected: int
    indeterminate: int
    recovered: int
    pending: int
    clean_errors: int
    unclean_errors: int
    streams_without_error_event: int
    residency_violations: int


class ResidencyViolationModel(_Model):
    key: str
    tenant: str
    zone: str
    region: str
    seen_by: str


class ExamplesModel(_Model):
    """Up to MAX_EXAMPLES keys of each non-empty list (sorted, as the checker returns them)."""

    lost: list[str]
    duplicated: list[str]
    unexpected: list[str]
    indeterminate: list[str]
    recovered: list[str]
    pending: list[str]
    unclean_errors: list[str]
    streams_without_error_event: list[str]
    residency_violations: list[ResidencyViolationModel]


class SteadyStateModel(_Model):
    window_s: float
    success_rate: float | None
    p99_ms: float | None
    min_success_rate: float
    max_p99_ms: float | None


class DuringFaultModel(_Model):
    requests: int
    error_rate: float | None
    p99_ms: float | None
    max_latency_ms: float | None


class CriterionModel(_Model):
    name: str
    passed: bool
    measured: float | None
    bound: float | None
    detail: str


class VerdictModel(_Model):
    passed: bool
    criteria: list[CriterionModel]


class TimelineModel(_Model):
    bucket_s: float
    starts_s: list[float]
    regions: list[str]
    requests_per_s: dict[str, list[float]]
    errors_per_s: dict[str, list[float]]
    p99_ms: list[float | None]


class ReportModel(_Model):
    """report.json. Field order is the key order in the file; mappings are sorted by key."""

    version: int
    drill: str
    description: str
    short: bool
    started_at: str
    duration_s: float
    passed: bool
    aborted: str | None
    fault: FaultModel
    events: list[EventModel]
    counts: CountsModel
    examples: ExamplesModel
    steady_state: SteadyStateModel
    during_fault: DuringFaultModel
    recovery_s: float | None
    invariants: dict[str, bool]
    verdict: VerdictModel
    not_checked: list[str]
    timeline: TimelineModel


def _r(x: float | None, digits: int) -> float | None:
    """Round for the report; None and infinities pass through unchanged."""
    if x is None or not math.isfinite(x):
        return x
    return round(x, digits)


def _s(x: float) -> float:
    return round(x, 3) if math.isfinite(x) else x


def _utc_iso(t: datetime) -> str:
    # A naive time is taken to be UTC already, as RunReport documents.
    t = t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    return t.isoformat()


def _report_model(report: RunReport, timeline: Timeline, not_checked: Sequence[str]) -> ReportModel:
    r, d = report.result, report.drill
    target = {k: str(v) for k, v in d.fault.target.model_dump(exclude_none=True).items()}
    return ReportModel(
        version=REPORT_VERSION,
        drill=d.name,
        description=d.description.strip(),
        short=report.short,
        started_at=_utc_iso(report.started_at),
        duration_s=_s(report.duration_s),
        passed=report.passed,
        aborted=report.aborted,
        fault=FaultModel(
            kind=d.fault.kind,
            target=dict(sorted(target.items())),
            params=dict(sorted(d.fault.params.items())),
            planned_start_s=_s(d.fault.start_s),
            planned_end_s=_s(d.fault.end_s),
            start_s=_s(report.fault_start_s),
            end_s=_s(report.fault_end_s),
        ),
        events=[EventModel(at_s=_s(e.at_s), action=e.action, detail=e.detail) for e in report.events],
        counts=CountsModel(
            attempts=r.attempts,
            acknowledged=r.acknowledged,
            ok=r.ok,
            lost=len(r.lost),
            duplicated=len(r.duplicated),
            unexpected=len(r.unexpected),
            indeterminate=len(r.indeterminate),
            recovered=len(r.recovered),
            pending=len(r.pending),
            clean_errors=len(r.clean_errors),
            unclean_errors=len(r.unclean_errors),
            streams_without_error_event=len(r.streams_without_error_event),
            residency_violations=len(r.residency_violations),
        ),
        examples=ExamplesModel(
            lost=list(r.lost[:MAX_EXAMPLES]),
            duplicated=list(r.duplicated[:MAX_EXAMPLES]),
            unexpected=list(r.unexpected[:MAX_EXAMPLES]),
            indeterminate=list(r.indeterminate[:MAX_EXAMPLES]),
            recovered=list(r.recovered[:MAX_EXAMPLES]),
            pending=list(r.pending[:MAX_EXAMPLES]),
            unclean_errors=list(r.unclean_errors[:MAX_EXAMPLES]),
            streams_without_error_event=list(r.streams_without_error_event[:MAX_EXAMPLES]),
            residency_violations=[
                ResidencyViolationModel(
                    key=v.key, tenant=v.tenant, zone=v.zone, region=v.region, seen_by=v.seen_by
                )
                for v in r.residency_violations[:MAX_EXAMPLES]
            ],
        ),
        steady_state=SteadyStateModel(
            window_s=_s(d.steady_state.window_s),
            success_rate=_r(r.steady_state_success_rate, 4),
            p99_ms=_r(r.steady_state_p99_ms, 1),
            min_success_rate=d.steady_state.min_success_rate,
            max_p99_ms=d.steady_state.max_p99_ms,
        ),
        during_fault=DuringFaultModel(
            requests=r.requests_during_fault,
            error_rate=_r(r.error_rate_during_fault, 4),
            p99_ms=_r(r.p99_during_fault_ms, 1),
            max_latency_ms=_r(r.max_latency_during_fault_ms, 1),
        ),
        recovery_s=_r(r.recovery_s, 3),
        invariants=dict(sorted(report.invariants.items())),
        verdict=VerdictModel(
            passed=report.verdict.passed,
            criteria=[
                CriterionModel(
                    name=c.name,
                    passed=c.passed,
                    measured=_r(c.measured, 4),
                    bound=_r(c.bound, 4),
                    detail=c.detail,
                )
                for c in report.verdict.criteria
            ],
        ),
        not_checked=list(not_checked),
        timeline=TimelineModel(
            bucket_s=timeline.bucket_s,
            starts_s=[_s(x) for x in timeline.starts_s],
            regions=list(timeline.regions),
            requests_per_s={k: [round(x, 3) for x in v] for k, v in timeline.requests_per_s.items()},
            errors_per_s={k: [round(x, 3) for x in v] for k, v in timeline.errors_per_s.items()},
            p99_ms=[_r(x, 1) for x in timeline.p99_ms],
        ),
    )


# --- formatting shared by the CLI table and the markdown ----------------------------------


def _verdict_word(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _number(x: float) -> str:
    if math.isinf(x):
        return "∞"
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def _format(name: str, value: float | None) -> str:
    """A criterion's measured value or bound in the unit its name implies."""
    if value is None:
        return "n/a"
    if name.startswith("invariant:"):
        return "yes" if value else "no"
    if name in ("steady_state_before_fault", "error_rate_during_fault"):
        return f"{value * 100:.2f}%"
    if name.endswith("_ms"):
        return "∞ ms" if math.isinf(value) else f"{value:.1f} ms"
    if name.endswith("_s"):
        return f"{value:.2f} s"
    return _number(value)


def _measured(c: CriterionResult) -> str:
    if c.name.startswith("invariant:") and c.measured is None:
        return "not observed"
    return _format(c.name, c.measured)


def _bound(c: CriterionResult) -> str:
    if c.name.startswith("invariant:"):
        return "yes"
    if c.bound is None:
        return "n/a"
    # The steady state is the one lower bound; every other criterion is an upper bound.
    return ("≥ " if c.name == "steady_state_before_fault" else "≤ ") + _format(c.name, c.bound)


def summary_rows(report: RunReport) -> list[tuple[str, str, str, str]]:
    """(criterion, measured, bound, PASS/FAIL) per criterion, plus an `aborted` row when it was."""
    rows = [(c.name, _measured(c), _bound(c), _verdict_word(c.passed)) for c in report.verdict.criteria]
    if report.aborted is not None:
        rows.append(("aborted", report.aborted, "not aborted", "FAIL"))
    return rows


def _cell(text: str) -> str:
    # A pipe or a newline would break the markdown table row.
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _opt(x: float | None, fmt: str, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "∞" + unit
    return format(x, fmt) + unit


def _markdown(report: RunReport, not_checked: Sequence[str], png: str | None) -> str:
    r, d = report.result, report.drill
    word = _verdict_word(report.passed)
    target = ", ".join(f"{k}={v}" for k, v in sorted(d.fault.target.model_dump(exclude_none=True).items()))
    out = [
        f"# Drill `{d.name}`: {word}",
        "",
        f"{'Short' if report.short else 'Full'} run, started {_utc_iso(report.started_at)}, "
        f"{report.duration_s:.1f} s of load.",
        "",
    ]
    if report.aborted is not None:
        out += [f"> **Aborted:** {report.aborted}", ""]
    out += [
        d.description.strip(),
        "",
        "## Fault",
        "",
        f"`{d.fault.kind}` on {target}: planned [{d.fault.start_s:g}, {d.fault.end_s:g}) s, "
        f"applied [{report.fault_start_s:.2f}, {report.fault_end_s:.2f}) s.",
        "",
        "## Criteria",
        "",
    ]
    details = {c.name: c.detail for c in report.verdict.criteria}
    out += _table(
        ["criterion", "measured", "bound", "result", "detail"],
        [
            (f"`{name}`", m, b, f"**{res}**" if res == "FAIL" else res, details.get(name, ""))
            for name, m, b, res in summary_rows(report)
        ],
    )
    counts = [
        ("attempts", r.attempts),
        ("acknowledged", r.acknowledged),
        ("ok", r.ok),
        ("lost", len(r.lost)),
        ("duplicated", len(r.duplicated)),
        ("unexpected", len(r.unexpected)),
        ("indeterminate", len(r.indeterminate)),
        ("recovered", len(r.recovered)),
        ("pending", len(r.pending)),
        ("clean errors", len(r.clean_errors)),
        ("unclean errors", len(r.unclean_errors)),
        ("streams without error event", len(r.streams_without_error_event)),
        ("residency violations", len(r.residency_violations)),
    ]
    out += ["", "## Counts", ""] + _table(["count", "value"], [(k, str(v)) for k, v in counts])
    examples = [
        (name, keys)
        for name, keys in (
            ("lost", r.lost),
            ("duplicated", r.duplicated),
            ("unexpected", r.unexpected),
            ("unclean errors", r.unclean_errors),
            ("streams without error event", r.streams_without_error_event),
            (
                "residency violations",
                tuple(
                    f"{v.key} ({v.zone} tenant {v.tenant} in {v.region}, seen by {v.seen_by})"
                    for v in r.residency_violations
                ),
            ),
        )
        if keys
    ]
    if examples:
        out += ["", "Examples (see report.json for more):", ""]
        for name, keys in examples:
            more = f" and {len(keys) - MD_EXAMPLES} more" if len(keys) > MD_EXAMPLES else ""
            out.append(f"- {name}: " + ", ".join(f"`{k}`" for k in keys[:MD_EXAMPLES]) + more)
    ss = d.steady_state
    out += [
        "",
        "## Figures",
        "",
        *_table(
            ["figure", "value"],
            [
                (
                    f"steady-state success rate ({ss.window_s:g} s before the fault)",
                    _opt(
                        None if r.steady_state_success_rate is None else r.steady_state_success_rate * 100,
                        ".2f",
                        "%",
                    ),
                ),
                ("steady-state p99", _opt(r.steady_state_p99_ms, ".1f", " ms")),
                ("requests during the fault", str(r.requests_during_fault)),
                (
                    "error rate during the fault",
                    _opt(
                        None if r.error_rate_during_fault is None else r.error_rate_during_fault * 100,
                        ".2f",
                        "%",
                    ),
                ),
                ("p99 during the fault", _opt(r.p99_during_fault_ms, ".1f", " ms")),
                ("max latency during the fault", _opt(r.max_latency_during_fault_ms, ".1f", " ms")),
                ("recovery", "did not recover" if r.recovery_s is None else f"{r.recovery_s:.2f} s"),
            ],
        ),
        "",
        "## Fault events",
        "",
    ]
    if report.events:
        out += _table(
            ["at (s)", "action", "detail"], [(f"{e.at_s:.2f}", e.action, e.detail) for e in report.events]
        )
    else:
        out.append("None recorded.")
    out += ["", "## Invariants", ""]
    if report.invariants:
        out += _table(
            ["invariant", "observed"],
            [(f"`{k}`", "yes" if v else "**no**") for k, v in sorted(report.invariants.items())],
        )
    else:
        out.append("None observed.")
    if not_checked:
        out += ["", "## Not checked", ""] + [f"- {n}" for n in not_checked]
    if png is not None:
        out += ["", "## Timeline", "", f"![timeline of {d.name}]({png})"]
    return "\n".join(out) + "\n"


# --- the PNG ------------------------------------------------------------------------------


def _draw_timeline(report: RunReport, timeline: Timeline) -> bytes | None:
    """The timeline as PNG bytes; None when matplotlib is not installed."""
    try:
        # The object API with its own Agg canvas: no pyplot, so no global figure registry
        # and no change to the process's default backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 8.5), dpi=100)
    FigureCanvasAgg(fig)
    # Fixed margins, legends in the right margin: constrained layout would double the drawing time.
    fig.subplots_adjust(left=0.07, right=0.8, top=0.92, bottom=0.07, hspace=0.1)
    ax_req, ax_err, ax_p99 = fig.subplots(3, 1, sharex=True)
    xs = list(timeline.starts_s)
    # steps-post draws bucket i flat from its start to the next point: one more point closes the last bucket.
    edges = [*xs, xs[-1] + timeline.bucket_s] if xs else []
    colours = [
        "tab:blue",
        "tab:orange",
        "tab:green",
        "tab:purple",
        "tab:brown",
        "tab:pink",
        "tab:olive",
        "tab:cyan",
    ]
    for n, region in enumerate(timeline.regions):
        # Red is the fault's colour; unanswered requests ("none") are grey so they do not read as regions.
        style = (
            {"color": "dimgrey", "linestyle": "--"}
            if region == NO_REGION
            else {"color": colours[n % len(colours)]}
        )
        for ax, series in (
            (ax_req, timeline.requests_per_s[region]),
            (ax_err, timeline.errors_per_s[region]),
        ):
            ax.plot(
                edges, [*series, series[-1]], drawstyle="steps-post", label=region, linewidth=1.2, **style
            )
    # At bucket centres; NaN leaves a gap where a bucket had no ok request instead of drawing through it.
    centres = [x + timeline.bucket_s / 2 for x in xs]
    p99 = [math.nan if p is None else p for p in timeline.p99_ms]
    ax_p99.plot(centres, p99, marker=".", linewidth=1.2, color="tab:purple", label="p99 (ok requests)")
    if report.drill.steady_state.max_p99_ms is not None:
        ax_p99.axhline(
            report.drill.steady_state.max_p99_ms,
            color="grey",
            linestyle=":",
            linewidth=1,
            label="steady-state p99 bound",
        )
    fs, fe = report.fault_start_s, report.fault_end_s
    for ax in (ax_req, ax_err, ax_p99):
        ax.axvspan(fs, fe, color="tab:red", alpha=0.12, linewidth=0)
        ax.axvline(fs, color="tab:red", linestyle="--", linewidth=1)
        ax.axvline(fe, color="tab:red", linestyle="--", linewidth=1)
        trans = ax.get_xaxis_transform()  # x in seconds, y in axes fractions: markers sit on the top edge
        for e in report.events:
            ax.plot([e.at_s], [1.0], marker="v", color="black", markersize=5, transform=trans, clip_on=False)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    for e in report.events:
        ax_req.annotate(
            e.action,
            (e.at_s, 1.0),
            xycoords=ax_req.get_xaxis_transform(),
            xytext=(2, 4),
            textcoords="offset points",
            fontsize=7,
            rotation=30,
        )
    ax_req.set_ylabel("requests/s")
    ax_err.set_ylabel("errors/s")
    ax_p99.set_ylabel("p99 latency (ms)")
    ax_p99.set_xlabel("seconds since load start")
    if timeline.regions:
        ax_req.legend(
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="region", title_fontsize=8
        )
    ax_p99.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax_p99.set_xlim(min([0.0, *edges]), max([report.duration_s, report.drill.load.duration_s, *edges]))
    mode = "short" if report.short else "full"
    fig.suptitle(
        f"{report.drill.name} ({mode}): {_verdict_word(report.passed)}  fault [{fs:.1f}, {fe:.1f}) s shaded"
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# --- writing ------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file private (0600); a report is for anyone who can read the run's directory.
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(report: RunReport, history: History, out_dir: Path) -> ReportFiles:
    """Write report.json, report.md and timeline.png (when matplotlib is installed) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timeline = timeline_series(history)
    not_checked = list(report.not_checked)
    png_path: Path | None = out_dir / "timeline.png"
    png = _draw_timeline(report, timeline)
    if png is None:
        not_checked.append(NO_MATPLOTLIB)
        png_path = None
    else:
        # The PNG first: the markdown links to it, so it should exist by the time the md does.
        _write_atomic(out_dir / "timeline.png", png)
    model = _report_model(report, timeline, not_checked)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    _write_atomic(json_path, (model.model_dump_json(indent=2) + "\n").encode("utf-8"))
    _write_atomic(
        md_path, _markdown(report, not_checked, None if png_path is None else png_path.name).encode("utf-8")
    )
    return ReportFiles(report_json=json_path, report_md=md_path, timeline_png=png_path)


def _first_failure(report: RunReport) -> str:
    failures = report.verdict.failures()
    if failures:
        c = failures[0]
        return f"{c.name} ({_measured(c)})"
    if report.aborted is not None:
        return f"aborted: {report.aborted}"
    return ""


def write_suite_summary(reports: Sequence[RunReport], out_dir: Path) -> Path:
    """Write summary.md, one table row per drill run, into out_dir; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    passed = sum(r.passed for r in reports)
    lines = [
        f"# Chaos drills: {passed} of {len(reports)} passed",
        "",
        *_table(
            ["drill", "short", "verdict", "lost", "duplicated", "recovery_s", "first failing criterion"],
            [
                (
                    r.drill.name,
                    "yes" if r.short else "no",
                    _verdict_word(r.passed) if r.passed else f"**{_verdict_word(r.passed)}**",
                    str(len(r.result.lost)),
                    str(len(r.result.duplicated)),
                    "n/a" if r.result.recovery_s is None else f"{r.result.recovery_s:.2f}",
                    _first_failure(r),
                )
                for r in reports
            ],
        ),
    ]
    path = out_dir / "summary.md"
    _write_atomic(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return path


__all__ = [
    "FaultEvent",
    "NO_MATPLOTLIB",
    "NO_REGION",
    "ReportFiles",
    "ReportModel",
    "RunReport",
    "Timeline",
    "summary_rows",
    "timeline_series",
    "write_report",
    "write_suite_summary",
]
