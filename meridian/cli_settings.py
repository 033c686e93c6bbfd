"""Settings for a `meridian` command: the one way every plane's Typer sub-app reads them.

Each plane owns its commands (`control_plane/cli.py`, `geo_router/cli.py`, …) and the CLI
composes them, so the rule they share lives in the kernel: the environment first, then the
flags that were given; invalid values and weak shared secrets are a few red lines on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

from typing import Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console

from meridian.security import weak_secrets

T = TypeVar("T")

err_console = Console(stderr=True)


def settings_or_exit(cls: type[T], **overrides: Any) -> T:
    """`cls` from the environment and the flags that were given (None: not given); exit 2 when invalid."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = cls(**given)
    except ValidationError as e:
        err_console.print(f"[red]invalid settings for {cls.__name__}:[/red]")
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            err_console.print(f"  {loc}: {err['msg']}")
        raise typer.Exit(2) from None
    weak = weak_secrets(settings)
    if weak:
        err_console.print(f"[red]weak secrets in {cls.__name__}:[/red]")
        for problem in weak:
            err_console.print(f"  {problem}")
        err_console.print("  make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        raise typer.Exit(2)
    return settings
