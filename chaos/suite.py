"""What `meridian chaos run` does (chaos/cli.py): run drills against a local fabric or a
deployment, showing each one's steps, progress and fault events as it runs
(chaos.progress), then each verdict as a table and where the report is. The command
imports this module when it runs: it loads the runners and the local fabric."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from chaos.deployed import DeployedRunOptions, run_drill_on, runnable_on
from chaos.deployment import Deployment
from chaos.drill import Drill
from chaos.progress import DrillProgress
from chaos.report import summary_rows, write_suite_summary
from chaos.runner import RunOptions, run_drill, runnable
from chaos.schedule import RunOutcome
from meridian.cli_format import folding_table


@dataclass(frozen=True)
class DrillRunner:
    """Where drills run: why one cannot, and how one runs (into its report folder, telling
    the progress display its steps, ticks and events)."""

    where: str
    why_not: Callable[[Drill], str | None]
    run: Callable[[Drill, Path, DrillProgress], RunOutcome]


def local_runner(out_dir: Path, *, short: bool, seed: int, redis_url: str) -> DrillRunner:
    """Drills against a local fabric each run starts (the tiny model made once per suite)."""

    def run_one(drill: Drill, out: Path, progress: DrillProgress) -> RunOutcome:
        return run_drill(drill, RunOptions(out_dir=out, short=short, seed=seed, redis_url=redis_url,
                                           model_cache_dir=out_dir / ".model-cache", on_step=progress.step,
                                           on_tick=progress.tick, on_event=progress.event))

    return DrillRunner("a local fabric", runnable, run_one)


def deployment_runner(deployment: Deployment, *, short: bool, seed: int) -> DrillRunner:
    """Drills against a running deployment, with the actions its file gives."""

    def run_one(drill: Drill, out: Path, progress: DrillProgress) -> RunOutcome:
        return run_drill_on(drill, deployment, DeployedRunOptions(
            out_dir=out, short=short, seed=seed, on_step=progress.step, on_tick=progress.tick,
            on_event=progress.event))

    return DrillRunner(f"deployment {deployment.name}", lambda d: runnable_on(d, deployment), run_one)


def pick(drills: list[Drill], names: list[str]) -> list[Drill]:
    """The drills named (`all`: every one); ValueError naming an unknown drill."""
    if names == ["all"]:
        return drills
    by_name = {d.name: d for d in drills}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown drill {', '.join(unknown)}; `meridian chaos list` shows them")
    return [by_name[n] for n in names]


def run(drills: list[Drill], out_dir: Path, runner: DrillRunner, *, short: bool, console: Console) -> bool:
    """Run `drills` one after another; True when every runnable one passed.

    A drill the runner cannot run is reported as such and fails the suite: it is an
    untested failure mode, not a pass.
    """
    outcomes: list[RunOutcome] = []
    skipped: list[tuple[str, str]] = []
    for drill in drills:
        why = runner.why_not(drill)
        if why is not None:
            console.print(f"[yellow]{drill.name}: not run: {why}[/yellow]")
            skipped.append((drill.name, why))
            continue
        outcomes.append(_run_one(drill, out_dir / drill.name, runner, short, console))
    if len(drills) > 1 and outcomes:
        summary = write_suite_summary([o.report for o in outcomes], out_dir)
        console.print(f"suite summary: {summary}")
    for name, why in skipped:
        console.print(f"[red]NOT RUN[/red] {name}: {why}")
    return not skipped and all(o.passed for o in outcomes)


def _run_one(drill: Drill, out: Path, runner: DrillRunner, short: bool, console: Console) -> RunOutcome:
    form = drill.short_version() if short else drill
    with DrillProgress(drill.name, form.fault, runner.where, console) as progress:
        outcome = runner.run(drill, out, progress)
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
    table = folding_table("criterion", "measured", "bound", "result", title=title)
    for name, measured, bound, result in summary_rows(report):
        style = "green" if result == "PASS" else "red"
        table.add_row(name, measured, bound, f"[{style}]{result}[/{style}]")
    return table
