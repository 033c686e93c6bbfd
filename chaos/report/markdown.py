"""report.md and summary.md, for people: the verdict, the criteria with their measured values
and bounds, the counts and figures, the fault's events. The CLI's table reads the same
criterion rows (`summary_rows`), so the terminal and the file say the same thing."""

from __future__ import annotations

import math
from collections.abc import Sequence

from chaos.checker import CriterionResult
from chaos.report.inputs import RunReport, utc_iso, verdict_word
from chaos.report.json_model import counts

MD_EXAMPLES = 5  # offending keys listed per count in report.md, where a person reads them


# Criteria whose bound is a floor (the measured value must reach it), not a ceiling.
_AT_LEAST = frozenset({"steady_state_before_fault", "migrated_streams"})

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
    return ("≥ " if c.name in _AT_LEAST else "≤ ") + _format(c.name, c.bound)


def summary_rows(report: RunReport) -> list[tuple[str, str, str, str]]:
    """(criterion, measured, bound, PASS/FAIL) per criterion, plus an `aborted` row when it was."""
    rows = [(c.name, _measured(c), _bound(c), verdict_word(c.passed)) for c in report.verdict.criteria]
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


def _percent(x: float | None) -> str:
    return _opt(None if x is None else x * 100, ".2f", "%")


def report_markdown(report: RunReport, not_checked: Sequence[str], png: str | None) -> str:
    """report.md: `png` is the timeline's file name next to it, None when none was drawn."""
    d = report.drill
    out = _head(report) + _criteria(report) + _counts(report) + _figures(report) + _streams(report)
    out += _events(report)
    out += _invariants(report)
    if not_checked:
        out += ["", "## Not checked", ""] + [f"- {n}" for n in not_checked]
    if png is not None:
        out += ["", "## Timeline", "", f"![timeline of {d.name}]({png})"]
    return "\n".join(out) + "\n"


def _head(report: RunReport) -> list[str]:
    d = report.drill
    target = ", ".join(f"{k}={v}" for k, v in sorted(d.fault.target.model_dump(exclude_none=True).items()))
    out = [
        f"# Drill `{d.name}`: {verdict_word(report.passed)}",
        "",
        f"{'Short' if report.short else 'Full'} run, started {utc_iso(report.started_at)}, "
        f"{report.duration_s:.1f} s of load.",
        "",
    ]
    if report.aborted is not None:
        out += [f"> **Aborted:** {report.aborted}", ""]
    return out + [
        d.description.strip(),
        "",
        "## Fault",
        "",
        f"`{d.fault.kind}` on {target}: planned [{d.fault.start_s:g}, {d.fault.end_s:g}) s, "
        f"applied [{report.fault_start_s:.2f}, {report.fault_end_s:.2f}) s.",
        "",
    ]


def _criteria(report: RunReport) -> list[str]:
    details = {c.name: c.detail for c in report.verdict.criteria}
    return ["## Criteria", ""] + _table(
        ["criterion", "measured", "bound", "result", "detail"],
        [
            (f"`{name}`", m, b, f"**{res}**" if res == "FAIL" else res, details.get(name, ""))
            for name, m, b, res in summary_rows(report)
        ],
    )


def _counts(report: RunReport) -> list[str]:
    r = report.result
    rows = [(name.replace("_", " "), str(value)) for name, value in counts(r).items()]
    out = ["", "## Counts", ""] + _table(["count", "value"], rows)
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
    return out


def _figures(report: RunReport) -> list[str]:
    r, ss = report.result, report.drill.steady_state
    rows = [
        (f"steady-state success rate ({ss.window_s:g} s before the fault)", _percent(r.steady_state_success_rate)),
        ("steady-state p99", _opt(r.steady_state_p99_ms, ".1f", " ms")),
        ("requests during the fault", str(r.requests_during_fault)),
        ("error rate during the fault", _percent(r.error_rate_during_fault)),
        ("p99 during the fault", _opt(r.p99_during_fault_ms, ".1f", " ms")),
        ("max latency during the fault", _opt(r.max_latency_during_fault_ms, ".1f", " ms")),
        ("recovery", "did not recover" if r.recovery_s is None else f"{r.recovery_s:.2f} s"),
    ]
    return ["", "## Figures", "", *_table(["figure", "value"], rows)]


def _streams(report: RunReport) -> list[str]:
    s = report.result.streams
    if s is None:
        return []
    rows = [
        ("long streams", str(s.streams)),
        ("completed ([DONE])", str(len(s.completed))),
        ("migrated", f"{len(s.migrated)} (at most {s.max_migrations} times each)"),
        ("clean errors, no replica in the zone", str(len(s.clean_no_replica))),
        ("broken", str(len(s.broken))),
        ("token mismatches", str(len(s.token_mismatches))),
        ("diverged (numerics, away from any seam)", str(len(s.diverged))),
        ("identity mismatches (ids, usage)", str(len(s.identity_mismatches))),
        ("residency violations", str(len(s.residency_violations))),
        ("resume latency p99 / max", f"{_opt(s.resume_p99_s, '.3f', ' s')} / "
                                     f"{_opt(max(s.resume_s) if s.resume_s else None, '.3f', ' s')}"),
        ("one prefill of the longest prompt", _opt(s.prefill_s, '.4f', ' s')),
    ]
    out = ["", "## Long streams", "", *_table(["figure", "value"], rows)]
    examples = [(name, keys) for name, keys in (("broken", s.broken), ("token mismatches", s.token_mismatches)) if keys]
    if examples:
        out.append("")
    for name, keys in examples:
        if keys:
            more = f" and {len(keys) - MD_EXAMPLES} more" if len(keys) > MD_EXAMPLES else ""
            out.append(f"- {name}: " + ", ".join(f"`{k}`" for k in keys[:MD_EXAMPLES]) + more)
    return out


def _events(report: RunReport) -> list[str]:
    out = ["", "## Fault events", ""]
    if not report.events:
        return [*out, "None recorded."]
    return out + _table(["at (s)", "action", "detail"], [(f"{e.at_s:.2f}", e.action, e.detail) for e in report.events])


def _invariants(report: RunReport) -> list[str]:
    out = ["", "## Invariants", ""]
    if not report.invariants:
        return [*out, "None observed."]
    return out + _table(
        ["invariant", "observed"], [(f"`{k}`", "yes" if v else "**no**") for k, v in sorted(report.invariants.items())]
    )


def _first_failure(report: RunReport) -> str:
    failures = report.verdict.failures()
    if failures:
        c = failures[0]
        return f"{c.name} ({_measured(c)})"
    if report.aborted is not None:
        return f"aborted: {report.aborted}"
    return ""


def suite_markdown(reports: Sequence[RunReport]) -> str:
    """summary.md: one table row per drill run."""
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
                    verdict_word(r.passed) if r.passed else f"**{verdict_word(r.passed)}**",
                    str(len(r.result.lost)),
                    str(len(r.result.duplicated)),
                    "n/a" if r.result.recovery_s is None else f"{r.result.recovery_s:.2f}",
                    _first_failure(r),
                )
                for r in reports
            ],
        ),
    ]
    return "\n".join(lines) + "\n"
