"""`meridian --config FILE` and `meridian config check|example`: the YAML config file.

The file (meridian.config_file) is checked before any command runs on it, so a misspelt
key or a wrong type is a few `section.key: message` lines and exit code 2, never a
component that starts with a setting silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from meridian.cli_settings import settings_or_exit
from meridian.settings import LogSettings, config_file_path, use_config_file

if TYPE_CHECKING:
    from meridian.config_file import ConfigFileError

app = typer.Typer(no_args_is_help=True, help="The YAML config file (one section per component).")
console = Console()
err_console = Console(stderr=True)


def use(path: Path | None) -> None:
    """Check the config file in force (`path`, else MERIDIAN_CONFIG's) and make every
    settings class read it; exit 2 with its problems when it is not valid. The log
    settings are checked here too, before any component starts logging."""
    use_config_file(path)
    chosen = config_file_path()
    if chosen is not None:
        from meridian import config_file  # YAML: only when a file is given

        try:
            config_file.load(chosen)
        except config_file.ConfigFileError as e:
            _print_problems(e)
            raise typer.Exit(2) from None
    settings_or_exit(LogSettings)


def _print_problems(e: ConfigFileError) -> None:
    err_console.print(f"[red]invalid config file {escape(str(e.path))}:[/red]")
    for problem in e.problems:
        err_console.print(f"  {escape(problem)}")


@app.command("check")
def check(path: Annotated[Path, typer.Argument(help="The config file (YAML)")]) -> None:
    """Check every section of a config file: unknown sections or keys, wrong types (exit 1)."""
    from meridian import config_file

    try:
        sections = config_file.load(path)
    except config_file.ConfigFileError as e:
        _print_problems(e)
        raise typer.Exit(1) from None
    names = ", ".join(sections) or "no sections"
    console.print(f"OK: {escape(str(path))} ({names})")


@app.command("example")
def example() -> None:
    """Print a commented config file with every setting at its default."""
    from meridian import config_file

    print(config_file.example(), end="")
