"""`meridian chaos`: the drills' commands, mounted by the CLI (cli/main.py).

The drill files are read, and the runners (chaos.suite: the local fabric, the deployed
runner) loaded, by the commands themselves, so that the CLI starts without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from meridian.cli_format import OutputConsole

app = typer.Typer(no_args_is_help=True, help="Chaos drills: faults under load, checked from the request history.")

console = OutputConsole()  # piped: wide enough that no table row folds
err_console = Console(stderr=True)


def _error(e: Exception) -> None:
    """One line, unwrapped whatever the terminal's width (it names a file a user may grep for),
    the message's brackets printed as they are, not read as markup."""
    err_console.print(f"[red]{escape(str(e))}[/red]", highlight=False, soft_wrap=True)

DirOpt = Annotated[
    Path | None, typer.Option("--dir", help="A folder of drill YAML files (default: the built-in drills)")
]


@app.command("list")
def chaos_list(directory: DirOpt = None) -> None:
    """The drills: their fault, its target, and how long each runs (in full and in CI's short form)."""
    from rich.table import Table

    from chaos.drill import DRILLS_DIR, DrillError, load_drills

    try:
        drills = load_drills(directory or DRILLS_DIR)
    except DrillError as e:
        _error(e)
        raise typer.Exit(2) from None
    table = Table(title=f"{len(drills)} drills")
    for column in ("drill", "fault", "target", "fault window", "full", "short", "what it proves"):
        table.add_column(column, overflow="fold")
    for d in drills:
        t = d.fault.target
        target = next((f"{k} {v}" for k, v in (("node", t.node), ("region", t.region), ("provider", t.provider),
                                                ("service", t.service), ("model", t.model)) if v), "-")
        short = d.short_version()
        table.add_row(d.name, d.fault.kind, target, f"{d.fault.start_s:g}–{d.fault.end_s:g} s",
                      f"{d.load.duration_s:g} s", f"{short.load.duration_s:g} s", d.description.splitlines()[0])
    console.print(table)


@app.command("run")
def chaos_run(
    drills: Annotated[list[str], typer.Argument(help="Drill names, or `all`")],
    short: Annotated[bool, typer.Option("--short/--full", help="CI's short form (each at most 60 s) or the full drill")] = False,
    out: Annotated[Path, typer.Option(help="Reports go to OUT/<drill>/ (report.json, report.md, timeline.png)")] = Path(
        ".meridian/chaos"),
    seed: Annotated[int, typer.Option(help="Seeds the load's arrivals and the injectors' choices")] = 0,
    directory: DirOpt = None,
    redis_url: Annotated[str, typer.Option(
        envvar="MERIDIAN_CHAOS_REDIS_URL", help="Redis for drills whose routers share state (through a fault proxy)"
    )] = "redis://127.0.0.1:6379/0",
    deployment: Annotated[Path | None, typer.Option(
        help="Run against this deployment (a YAML file: routers, control plane, journals, fault actions) "
             "instead of starting a local fabric"
    )] = None,
) -> None:
    """Run drills against a local fabric or a deployment; exit code 1 when one fails or cannot run."""
    from chaos import suite
    from chaos.deployment import DeploymentError, load_deployment
    from chaos.drill import DRILLS_DIR, DrillError, load_drills

    try:
        chosen = suite.pick(load_drills(directory or DRILLS_DIR), drills)
        if deployment is not None:
            target = load_deployment(deployment)
            target.admin_key()  # a missing key is a usage error, before any drill starts
            runner = suite.deployment_runner(target, short=short, seed=seed)
        else:
            runner = suite.local_runner(out, short=short, seed=seed, redis_url=redis_url)
    except (DrillError, DeploymentError, ValueError) as e:
        _error(e)
        raise typer.Exit(2) from None
    if not suite.run(chosen, out, runner, short=short, console=console):
        raise typer.Exit(1)
