"""How the CLI's admin commands reach the control plane, print what they get, and fail.

- The key and URL: `--api-key`/`--control-plane`, else `MERIDIAN_API_KEY`/`MERIDIAN_CONTROL_PLANE_URL`,
  else the local demo's `fabric.json` (`.meridian/demo/fabric.json`, written mode 0600 by the
  local fabric), so `meridian status` works right after `meridian demo` with nothing set. The
  demo's admin key is only sent to the demo's own control plane: with another URL given, the
  file is not used. A file others can read is ignored (as ssh ignores such a key), with a warning.
  A demo that is gone leaves its file behind: before its key is sent, the processes the file
  records must be alive and the control plane on its port must report the instance id the
  file records (its GET /health, which needs no key); otherwise the file is stale and the
  command says so, rather than talking to whatever listens on that port now.
- An answer that is not the control plane's (not problem+json) sends the CLI to look at what
  answered (its /health): a router or a node given as the control plane is named as such,
  rather than shown as a bare 404.
- Listings print a table, or with `-o json|yaml` the API's models as they came, and nothing else
  on stdout, so scripts can read them (notes go to stderr).
- Every failure is one red line on stderr (a 422 adds one line per field) and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

__all__ = ["OutputFormat", "OutputOpt", "emit"]

import httpx
import typer
from rich.console import Console

from meridian.admin_api import CONTROL_PLANE_SERVICE
from meridian.admin_client import AdminAPIError, AdminClient
from meridian.cli_format import OutputConsole, OutputFormat, OutputOpt, emit
from meridian.cli_settings import settings_or_exit
from meridian.settings.cli import CLISettings

console = OutputConsole()  # piped: wide enough that no table row folds
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


YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before deleting")]


def confirm(question: str, yes: bool) -> None:
    """Go on if --yes was given or the operator answers yes; otherwise exit 1, nothing changed."""
    if not yes and not typer.confirm(question, err=True):
        fail("nothing was deleted")


def fail_api(e: AdminAPIError) -> NoReturn:
    """The control plane's refusal: its status and detail, and each field error of a 422. An
    answer that is not a control plane's says what answered instead."""
    if e.status and not e.problem and e.base_url:
        who, _ = probe(e.base_url)
        if who in (Answerer.ROUTER, Answerer.NODE, Answerer.OTHER):
            what = who.value if who is Answerer.OTHER else f"{who.value}, not the control plane"
            fail(f"{e.base_url}: that is {what} ({e}); give the control plane's URL (--control-plane "
                 "or MERIDIAN_CONTROL_PLANE_URL)")
    fail(str(e), 2 if e.status == 422 else 1, e.field_errors())


@contextmanager
def api_errors() -> Iterator[None]:
    """Turn an AdminAPIError raised inside into `fail_api`."""
    try:
        yield
    except AdminAPIError as e:
        fail_api(e)


# --- what answers on a URL ------------------------------------------------------------------

# Seconds to wait for a /health answer: it is local work on the other side.
PROBE_TIMEOUT_S = 3.0


class Answerer(StrEnum):
    """What answered on a URL given as the control plane's, told by its /health."""

    CONTROL_PLANE = "the control plane"
    ROUTER = "a router"
    NODE = "a node"
    OTHER = "not a Meridian control plane"
    NOTHING = "nothing"


def who_answers(body: Any) -> Answerer:
    """Which process a /health body comes from: the control plane names its service; a router
    reports its routing-table version (or that it has none yet); a node its lifecycle phase."""
    from data_plane.lifecycle import Phase

    if not isinstance(body, dict):
        return Answerer.OTHER
    if body.get("service") == CONTROL_PLANE_SERVICE:
        return Answerer.CONTROL_PLANE
    if "routing_version" in body or body.get("status") == "no_routing_table":
        return Answerer.ROUTER
    if body.get("status") in {p.value for p in Phase}:
        return Answerer.NODE
    return Answerer.OTHER


def probe(base_url: str) -> tuple[Answerer, str | None]:
    """GET base_url/health (no key sent): what answers there, and the instance id it reports."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S)
        body = r.json()
    except httpx.HTTPError:
        return Answerer.NOTHING, None
    except ValueError:
        return Answerer.OTHER, None
    who = who_answers(body)
    instance = body.get("instance_id") if who is Answerer.CONTROL_PLANE else None
    return who, instance if isinstance(instance, str) else None


# --- the local demo's fabric.json ----------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except PermissionError:
        return True  # it exists, as another user's
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped) still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) is all there is


def stale_reason(state: dict[str, Any], alive: Callable[[int], bool],
                 answer: Callable[[], tuple[Answerer, str | None]]) -> str | None:
    """Why a demo's fabric.json no longer describes a running demo (None: it does).

    Its processes must not all be gone (a demo with a crashed node still runs), and its control
    plane's port must answer with the instance id the file records (when it records one).
    """
    pids = [p for p in (state.get("pids") or {}).values() if type(p) is int and p > 0]
    if pids and not any(alive(p) for p in pids):
        return "its processes have exited"
    who, instance = answer()
    if who is Answerer.NOTHING:
        return "nothing answers on its control plane's port"
    expected = state.get("control_plane_instance_id")
    if who is not Answerer.CONTROL_PLANE or (expected and instance != expected):
        what = who.value if who is not Answerer.CONTROL_PLANE else "another control plane"
        return f"{'something that is ' if who is Answerer.OTHER else ''}{what} answers on its port now"
    return None


def _demo_states() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each demo fabric.json here that is readable by its owner only and holds an admin key."""
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
            yield path, state


def _demo_key(url_given: str | None) -> tuple[str, str] | None:
    """The running demo's admin key and control plane URL (for `url_given`, when given); exit 1
    when the only demo found is stale."""
    stale: str | None = None
    for path, state in _demo_states():
        url = str(state.get("control_plane_url") or "").rstrip("/")
        if not url or (url_given and url_given.rstrip("/") != url):
            continue
        reason = stale_reason(state, _pid_alive, lambda url=url: probe(url))
        if reason is None:
            err_console.print(f"[dim]using the demo's admin key and control plane {url} from {path}[/dim]")
            return state["admin_key"], url
        stale = stale or (f"the demo at {url} is not running (stale {path}: {reason}); start it with "
                          "`make demo` or give --control-plane")
    if stale:
        fail(stale)
    return None


def admin_client(control_plane: str | None, api_key: str | None) -> AdminClient:
    """A client for the control plane named by the flags, the environment or the demo's state."""
    url_given = control_plane or os.environ.get("MERIDIAN_CONTROL_PLANE_URL")
    s = settings_or_exit(CLISettings, control_plane_url=control_plane)
    key = api_key or (s.api_key.get_secret_value() if s.api_key else None)
    url = s.control_plane_url
    if not key and (demo := _demo_key(url_given)) is not None:
        key, url = demo
    if not key:
        fail("an API key is needed: --api-key or MERIDIAN_API_KEY (or run `meridian demo` here)", 2)
    return AdminClient(url, key, s.timeout_s)
