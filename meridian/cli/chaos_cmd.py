"""`meridian chaos run`: run drills against a local fabric with a progress bar, then show
each verdict as a table and where the report is."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from chaos.drill import Drill
from chaos.load import LoadStats
from chaos.report import summary_rows, write_suite_summary
from chaos.runner import RunOptions, RunOutcome, run_drill, runnable


def pick(drills: list[Drill], names: list[str]) -> list[Drill]:
    """The drills named (`all`: every one); ValueError naming an unknown drill."""
    if names == ["all"]:
        return drills
    by_name = {d.name: d for d in drills}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown drill {', '.join(unknown)}; `meridian chaos list` shows them")
    return [by_name[n] for n in names]


def run(drills: list[Drill], out_dir: Path, *, short: bool, seed: int, redis_url: str, console: Console) -> bool:
    """Run `drills` one after another; True when every runnable one passed.

    A drill the local runner cannot run yet is reported as such and fails the suite: it is
    an untested failure mode, not a pass.
    """
    outcomes: list[RunOutcome] = []
    skipped: list[tuple[str, str]] = []
    for drill in drills:
        why = runnable(drill)
        if why is not None:
            console.print(f"[yellow]{drill.name}: not run: {why}[/yellow]")
            skipped.append((drill.name, why))
            continue
        options = RunOptions(out_dir=out_dir / drill.name, short=short, seed=seed, redis_url=redis_url,
                             model_cache_dir=out_dir / ".model-cache")
        outcomes.append(_run_one(drill, options, console))
    if len(drills) > 1 and outcomes:
        summary = write_suite_summary([o.report for o in outcomes], out_dir)
        console.print(f"suite summary: {summary}")
    for name, why in skipped:
        console.print(f"[red]NOT RUN[/red] {name}: {why}")
    return not skipped and all(o.passed for o in outcomes)


def _run_one(drill: Drill, options: RunOptions, console: Console) -> RunOutcome:
    form = drill.short_version() if options.short else drill
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(drill.name, total=form.load.duration_s, status="starting the fabric")

        def on_step(message: str) -> None:
            progress.update(task, status=message)

        def on_tick(now_s: float, duration_s: float, stats: LoadStats) -> None:
            f = form.fault
            phase = "fault" if f.start_s <= now_s < f.end_s else ("steady" if now_s < f.start_s else "recovery")
            progress.update(task, completed=min(now_s, duration_s), status=(
                f"{phase} · sent {stats.sent} ok {stats.ok} failed {stats.failed} "
                f"indeterminate {stats.indeterminate} in flight {stats.in_flight}"))

        options.on_step, options.on_tick = on_step, on_tick
        outcome = run_drill(drill, options)
    console.print(verdict_table(outcome))
    console.print(f"report: {outcome.files.report_md}  timeline: {outcome.files.timeline_png or '(not drawn)'}")
    return outcome


def verdict_table(outcome: RunOutcome) -> Table:
    """Criteria of one run as a table, with the verdict in the title."""
    report = outcome.report
    verdict = "[green]PASS[/green]" if outcome.passed else "[red]FAIL[/red]"
    title = f"{report.drill.name} ({'short' if report.short else 'full'}): {verdict}"
    if report.aborted:
        title += f" — aborted: {report.aborted}"
    table = Table(title=title)
    for column in ("criterion", "measured", "bound", "result"):
        table.add_column(column)
    for name, measured, bound, result in summary_rows(report):
        style = "green" if result == "PASS" else "red"
        table.add_row(name, measured, bound, f"[{style}]{result}[/{style}]")
    return table
