"""`meridian model push`: upload a checkpoint and its manifest, with its input checked first.

The manifest's zone is where the weights may live and which nodes may pull them: a zone no
region belongs to ("mars") would make weights no node can ever serve, and a typo in the URI's
scheme would surface only after the whole checkpoint was hashed. Both are checked before any
work, against every provider's regions, which is why the command is the CLI's (the data plane
does not see the providers) and mounted on the data plane's `model` sub-app.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.admin_session import console, fail
from meridian import residency
from meridian.cli_settings import settings_or_exit
from meridian.settings.node import WeightSettings

# http(s) origins and peers are read-only (data_plane.weights.origins raise OriginReadOnly).
READ_ONLY_SCHEMES = frozenset({"http", "https", "peer"})


def known_zones() -> set[str]:
    """Every residency zone some region of some provider (and the on-prem inventory) belongs to."""
    import os

    from providers.regions import region_catalog

    inventory = os.environ.get("MERIDIAN_CP_ONPREM_INVENTORY") or None
    return residency.known_zones(region_catalog(Path(inventory) if inventory else None).values())


def check_push_input(model_dir: Path, uri: str, zone: str) -> None:
    """Exit 2 with one red line unless the checkpoint, the URI's scheme and the zone are usable."""
    from data_plane.weights.origins import ORIGINS

    if not model_dir.is_dir():
        fail(f"{model_dir} is not a directory", 2)
    if not (model_dir / "config.json").is_file():
        fail(f"{model_dir} has no config.json: not a model checkpoint", 2)
    scheme, sep, _ = uri.partition("://")
    writable = sorted(set(ORIGINS.names()) - READ_ONLY_SCHEMES)
    if not sep or scheme.lower() not in writable:
        fail(f"cannot push to {uri!r}: the URI must start with one of {', '.join(s + '://' for s in writable)}", 2)
    zones = known_zones()
    if zone not in zones:  # residency: a zone an operator may name, not where it may be
        fail(f"unknown zone {zone!r}; known: {', '.join(sorted(zones))}", 2)


def model_push(
    model_dir: Annotated[Path, typer.Argument(help="Model directory (config, safetensors, tokenizer)")],
    uri: Annotated[str, typer.Argument(help="s3://bucket/prefix, gs://bucket/prefix or file:///dir")],
    name: Annotated[str | None, typer.Option(help="Model name in the manifest (default: the directory's)")] = None,
    zone: Annotated[str, typer.Option(help="Residency zone the weights may live in (eu, us, …) or global")] = "global",
) -> None:
    """Upload a model's files and its manifest (sizes, sha256, per-chunk digests)."""
    check_push_input(model_dir, uri, zone)
    settings = settings_or_exit(WeightSettings)
    from data_plane.weights import commands

    commands.push(model_dir, uri, settings, console, name=name, zone=zone)

