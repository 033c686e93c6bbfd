"""What `meridian model push / pull / cache` do: move model weights between a directory, an
origin and the node cache, with progress bars. The commands (data_plane/cli.py) import this
module when they run, so that `meridian --help` loads none of the weight machinery."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from data_plane.weights.cache import NodeCache
from data_plane.weights.manifest import Manifest
from data_plane.weights.pull import PullReport, WeightPuller
from data_plane.weights.push import push_model
from meridian.cli_format import folding_table, human_bytes
from meridian.settings.node import WeightSettings


def _bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=console,
    )


class _PullBar:
    """PullProgress shown as one rich bar: cached bytes count as done from the start."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task: TaskID | None = None

    def begin(self, manifest: Manifest, total_bytes: int, cached_bytes: int) -> None:
        self._task = self._progress.add_task(f"pull {manifest.name}", total=total_bytes, completed=cached_bytes)

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, nbytes)


def pull(uri: str, settings: WeightSettings, console: Console) -> PullReport:
    """Fill the local cache with the model at `uri` (no peers: an operator's pull)."""
    cache = NodeCache(settings.cache_dir, budget_bytes=settings.cache_budget_bytes)

    async def run() -> PullReport:
        puller = WeightPuller(settings, cache)
        try:
            with _bar(console) as progress:
                return await puller.pull(uri, progress=_PullBar(progress))
        finally:
            await puller.aclose()

    report = asyncio.run(run())
    m = report.model
    console.print(
        f"{m.manifest.name} ({m.digest[:12]}) cached at [bold]{m.path}[/bold]: "
        f"{human_bytes(report.fetched_bytes)} fetched from {report.source} in {report.seconds:.2f}s"
    )
    return report


def push(model_dir: Path, uri: str, settings: WeightSettings, console: Console, *, name: str | None, zone: str) -> Manifest:
    """Upload a model directory and its manifest to `uri`."""
    total = sum(p.stat().st_size for p in Path(model_dir).rglob("*") if p.is_file())

    async def run() -> Manifest:
        with _bar(console) as progress:
            hashing = progress.add_task("hash", total=total)
            upload = progress.add_task("upload", total=None)

            def ready(manifest: Manifest) -> None:
                progress.update(upload, total=manifest.total_bytes)

            return await push_model(
                model_dir, uri, settings, name=name, zone=zone,
                hashed=lambda n: progress.advance(hashing, n),
                uploaded=lambda n: progress.advance(upload, n),
                manifest_ready=ready,
            )

    manifest = asyncio.run(run())
    console.print(
        f"pushed {manifest.name} ({len(manifest.files)} files, {human_bytes(manifest.total_bytes)}, zone "
        f"{manifest.zone}) to [bold]{uri}[/bold]; manifest {manifest.digest[:12]}"
    )
    return manifest


def cache_table(settings: WeightSettings) -> Table:
    """The models in the local cache, least recently used first."""
    cache = NodeCache(settings.cache_dir, budget_bytes=settings.cache_budget_bytes)
    table = folding_table("model", "digest", "zone", "files", "size", "last used", "in use",
                          right=("files", "size"), title=f"weight cache {settings.cache_dir}")
    for m in cache.models():
        used = datetime.fromtimestamp(m.last_used, UTC).strftime("%Y-%m-%d %H:%M:%S") if m.last_used else "-"
        table.add_row(m.manifest.name, m.digest[:12], m.manifest.zone, str(len(m.manifest.files)),
                      human_bytes(m.size), used, "yes" if m.pinned else "")
    budget = settings.cache_budget_bytes
    table.caption = f"{human_bytes(cache.usage_bytes())} used" + (f" of {human_bytes(budget)}" if budget else "")
    return table
