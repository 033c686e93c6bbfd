"""How the CLI's admin commands reach the control plane, print what they get, and fail.

- The key and URL: `--api-key`/`--control-plane`, else `MERIDIAN_API_KEY`/`MERIDIAN_CONTROL_PLANE_URL`,
  else the local demo's `fabric.json` (`.meridian/demo/fabric.json`, written mode 0600 by the
  local fabric), so `meridian status` works right after `meridian demo` with nothing set. The
  demo's admin key is only sent to the demo's own control plane: with another URL given, the
  file is not used. A file others can read is ignored (as ssh ignores such a key), with a warning.
- Listings print a table, or with `-o json|yaml` the API's models as they came, and nothing else
  on stdout, so scripts can read them (notes go to stderr).
- Every failure is one red line on stderr (a 422 adds one line per field) and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

__all__ = ["OutputFormat", "OutputOpt", "emit"]

import typer
from rich.console import Console

from meridian.admin_client import AdminAPIError, AdminClient
from meridian.cli_format import OutputFormat, OutputOpt, emit
from meridian.cli_settings import settings_or_exit
from meridian.settings import CLISettings

console = Console()
err_console = Console(stderr=True)

# Where `meridian demo` leaves its state (localfabric writes it; cli/demo.py's default work dir).
DEMO_STATE_FILES = (Path(".meridian/demo/fabric.json"), Path(".meridian/demo-vllm/fabric.json"))


ControlPlaneOpt = Annotated[str | None, typer.Option("--control-plane", help="[MERIDIAN_CONTROL_PLANE_URL]")]
ApiKeyOpt = Annotated[str | None, typer.Option("--api-key", help="[MERIDIAN_API_KEY]")]


def fail(message: str, code: int = 1, details: Sequence[str] = ()) -> NoReturn:
    """One red line on stderr (and an indented line per detail), then exit `code`."""
    err_console.print(f"[red]{message}[/red]", highlight=False, soft_wrap=True)
    for line in details:
        err_console.print(f"  {line}", highlight=False, soft_wrap=True, markup=False)
    raise typer.Exit(code)


def fail_api(e: AdminAPIError) -> NoReturn:
    """The control plane's refusal: its status and detail, and each field error of a 422."""
    fail(str(e), 2 if e.status == 422 else 1, e.field_errors())


@contextmanager
def api_errors() -> Iterator[None]:
    """Turn an AdminAPIError raised inside into `fail_api`."""
    try:
        yield
    except AdminAPIError as e:
        fail_api(e)


def _demo_state() -> tuple[Path, dict[str, Any]] | None:
    """The first demo fabric.json here that is readable by its owner only and holds an admin key."""
    for path in DEMO_STATE_FILES:
        try:
            mode = path.stat().st_mode
        except OSError:
            continue
        if stat.S_IMODE(mode) & 0o077:
            err_console.print(f"[yellow]ignoring {path}: others can read it (chmod 600 {path})[/yellow]")
            continue
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            err_console.print(f"[yellow]ignoring {path}: {e}[/yellow]")
            continue
        if isinstance(state, dict) and isinstance(state.get("admin_key"), str):
            return path, state
    return None


def admin_client(control_plane: str | None, api_key: str | None) -> AdminClient:
    """A client for the control plane named by the flags, the environment or the demo's state."""
    url_given = control_plane or os.environ.get("MERIDIAN_CONTROL_PLANE_URL")
    s = settings_or_exit(CLISettings, control_plane_url=control_plane)
    key = api_key or (s.api_key.get_secret_value() if s.api_key else None)
    url = s.control_plane_url
    if not key:
        found = _demo_state()
        demo_url = str(found[1].get("control_plane_url") or "") if found else ""
        if found and demo_url and (not url_given or url_given.rstrip("/") == demo_url.rstrip("/")):
            key, url = found[1]["admin_key"], demo_url
            err_console.print(f"[dim]using the demo's admin key and control plane {url} from {found[0]}[/dim]")
    if not key:
        fail("an API key is needed: --api-key or MERIDIAN_API_KEY (or run `meridian demo` here)", 2)
    return AdminClient(url, key, s.timeout_s)
