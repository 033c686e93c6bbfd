"""The suite's results as a table for people (the JSON figures are bench.attacks')."""

from __future__ import annotations

from collections.abc import Sequence

from chaos.attacks.result import AttackResult, check

COLUMNS = ("attack", "target", "sent MB", "read MB", "cut off", "neighbour p50/p99 ms (idle)", "RSS MiB idle/peak/after",
           "verdict")


def _cut(r: AttackResult) -> str:
    o = r.outcome
    return f"{o.cut_off_s:.2f} s" if o.cut_off_s is not None else f"never ({o.ran_s:.1f} s)"


def row(r: AttackResult) -> tuple[str, ...]:
    read = r.outcome.detail.get("bytes_read")
    return (r.attack, r.target, f"{r.outcome.bytes_sent / 1e6:.1f}", "-" if read is None else f"{read / 1e6:.1f}",
            _cut(r),
            f"{r.neighbour_p50_ms:.1f}/{r.neighbour_p99_ms:.0f} ({r.idle_p50_ms:.1f}/{r.idle_p99_ms:.0f})",
            f"{r.rss_idle_mib:.0f}/{r.rss_peak_mib:.0f}/{r.rss_after_mib:.0f}",
            "held" if not check(r) else "FAILED")


def table(results: Sequence[AttackResult]) -> str:
    """A fixed-width table, one row per attack, then how each was cut off and each failure."""
    rows = [COLUMNS, *(row(r) for r in results)]
    widths = [max(len(x[i]) for x in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(x, widths, strict=True)).rstrip() for x in rows]
    lines += [f"{r.attack} ({r.target}): {r.outcome.how}" for r in results]
    lines += [failure for r in results for failure in check(r)]
    return "\n".join(lines)
