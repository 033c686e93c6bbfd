"""`meridian iac`: synthesise an infrastructure plan into Terraform JSON, and diff two plans.

The cdktf modules are imported inside the commands: loading the provider bindings takes about a
minute, which `meridian --help` should not pay. Every user error (missing or invalid plan, a plan
that cannot be synthesised, an output directory that is not ours, no cdktf or Node.js: see
iac.toolchain) exits 2 with one line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from iac import layout
from iac.layout import PlanError
from iac.toolchain import ToolchainError, check_toolchain
from meridian.infra_plan import InfraPlan

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Terraform stacks (cdktf) from an infrastructure plan.",
)
console = Console()
err_console = Console(stderr=True)

PlanOption = Annotated[
    Path, typer.Option("--plan", help="Infrastructure plan (JSON, meridian-infra-plan/v1)")
]


def _fail(message: str) -> NoReturn:
    # Messages are plain text: `[iac]` in a pip command is not markup.
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


def load_plan(path: Path) -> InfraPlan:
    """The plan in `path`; a one-line error and exit 2 when it is missing, unreadable or invalid."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _fail(f"plan file not found: {path}")
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        _fail(f"cannot read plan {path}: {e}")
    try:
        return InfraPlan.model_validate_json(text)
    except ValidationError as e:
        _fail(f"invalid plan {path}: {_validation_message(e)}")


def require_toolchain() -> None:
    """cdktf's packages and Node.js, checked before anything is loaded or written."""
    try:
        check_toolchain()
    except ToolchainError as e:
        _fail(str(e))


def _stack_names(plan: InfraPlan) -> list[str]:
    return [rs.name for rs in layout.region_stacks(plan)] + [layout.GLOBAL_STACK]


def _synth(plan: InfraPlan, out_dir: Path, label: str = "") -> list[Path]:
    """Synthesise with a progress line per stack; PlanError becomes a one-line exit 2."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        loading = progress.add_task(f"{label}loading the cdktf provider bindings (about a minute)", total=1)
        from iac.app import synth  # jsii start-up: paid only by the commands that synthesise

        progress.update(loading, completed=1, visible=False)
        tasks = {name: progress.add_task(f"{label}stack {name}", total=1) for name in _stack_names(plan)}
        writing = progress.add_task(f"{label}writing Terraform JSON", total=1, visible=False)

        def built(name: str) -> None:
            progress.update(tasks[name], completed=1, description=f"{label}stack {name} [green]built[/green]")
            if name == layout.GLOBAL_STACK:
                progress.update(writing, visible=True)

        try:
            paths = synth(plan, out_dir, on_stack=built)
        except PlanError as e:
            _fail(str(e))
        progress.update(writing, completed=1)
    for name in tasks:
        console.print(f"  [green]✓[/green] {label}{name}", highlight=False)
    return paths


def _summary(plan: InfraPlan, out_dir: Path, paths: list[Path]) -> Table:
    regions = {rs.name: rs.region.name for rs in layout.region_stacks(plan)}
    regions[layout.GLOBAL_STACK] = f"{plan.global_.region} (global)"
    manifest = json.loads((out_dir / "manifest.json").read_text(encoding="utf-8"))["stacks"]
    table = Table(title=f"{len(paths)} stacks in {out_dir}")
    table.add_column("stack", overflow="fold")
    table.add_column("region", overflow="fold")
    table.add_column("resources", justify="right")
    table.add_column("data sources", justify="right")
    table.add_column("apply after", overflow="fold")
    for path in paths:
        name = path.parent.name
        stack = json.loads(path.read_text(encoding="utf-8"))
        count = sum(len(v) for v in stack.get("resource", {}).values())
        data = sum(len(v) for v in stack.get("data", {}).values())
        table.add_row(
            name, regions.get(name, ""), str(count), str(data), ", ".join(manifest[name]["dependencies"])
        )
    return table


def _push_table(plan: InfraPlan) -> Table:
    table = Table(title="Push each model's weights to (other S3 buckets of its zone receive copies)")
    table.add_column("model", overflow="fold")
    table.add_column("weights URI", overflow="fold")
    for model, uri in layout.push_targets(plan):
        table.add_row(model, uri)
    return table


@app.command("synth")
def synth_command(
    plan: PlanOption,
    out: Annotated[
        Path, typer.Option("--out", help="Output directory (empty, or a previous synth's)")
    ] = Path("cdktf.out"),
) -> None:
    """Write one Terraform JSON stack per provider-region plus the global stack."""
    require_toolchain()
    infra = load_plan(plan)
    try:
        layout.region_stacks(infra)
        pushes = _push_table(infra)
    except PlanError as e:
        _fail(str(e))
    paths = _synth(infra, out)
    console.print(_summary(infra, out, paths))
    if pushes.row_count:
        console.print(pushes)
    console.print(
        f"apply with: terraform -chdir={out}/stacks/<stack> init && terraform -chdir={out}/stacks/<stack> "
        "apply (dependencies first: see manifest.json)",
        highlight=False,
    )
    console.print(
        f"the drivers find these groups and templates by name: set MERIDIAN_PROVIDER_AWS_NAME_PREFIX and "
        f"MERIDIAN_PROVIDER_GCP_NAME_PREFIX to {infra.name!r} (the plan's name); after apply the control "
        "plane owns the groups' sizes (Terraform ignores later changes to them)",
        highlight=False,
    )


@app.command("diff")
def diff_command(
    old: Annotated[Path, typer.Option("--old", help="The plan as it is (JSON)")],
    new: Annotated[Path, typer.Option("--new", help="The plan as it would be (JSON)")],
) -> None:
    """Synthesise two plans and show the resources that would be added, changed or removed."""
    require_toolchain()
    from iac.diff import diff_stacks, diff_table

    before, after = load_plan(old), load_plan(new)
    with tempfile.TemporaryDirectory(prefix="meridian-iac-diff-") as tmp:
        old_dir, new_dir = Path(tmp) / "old", Path(tmp) / "new"
        _synth(before, old_dir, label="old: ")
        _synth(after, new_dir, label="new: ")
        result = diff_stacks(old_dir, new_dir)
    if result.empty:
        console.print("no changes: both plans synthesise to the same Terraform")
        return
    console.print(diff_table(result))
    for name in result.added_stacks:
        console.print(f"[green]+ stack {name}[/green]")
    for name in result.removed_stacks:
        console.print(f"[red]- stack {name}[/red]")
