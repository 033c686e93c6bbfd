"""Upload a model directory and its manifest to an origin (`meridian model push`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from data_plane.weights.errors import first_error
from data_plane.weights.manifest import MANIFEST_NAME, Manifest, build_manifest
from data_plane.weights.origins import open_origin
from meridian.contracts import GLOBAL_ZONE
from meridian.settings.node import WeightSettings

# Files uploaded at once (each large one is itself uploaded in concurrent parts).
_FILES_IN_FLIGHT = 4


async def push_model(
    model_dir: Path,
    uri: str,
    settings: WeightSettings,
    *,
    name: str | None = None,
    zone: str = GLOBAL_ZONE,
    hashed: Callable[[int], None] | None = None,
    uploaded: Callable[[int], None] | None = None,
    manifest_ready: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Describe the directory, upload every file, then the manifest last: a reader never
    finds a manifest whose files are not all in place."""
    manifest = await asyncio.to_thread(
        build_manifest, model_dir, name=name, zone=zone, chunk_size=settings.manifest_chunk_bytes, progress=hashed
    )
    if manifest_ready is not None:
        manifest_ready(manifest)
    origin = open_origin(uri, settings)
    slots = asyncio.Semaphore(_FILES_IN_FLIGHT)

    async def upload(path: str) -> None:
        async with slots:
            await origin.write(path, Path(model_dir) / path, uploaded)

    try:
        async with asyncio.TaskGroup() as group:
            for f in manifest.files:
                group.create_task(upload(f.path))
        await origin.write_bytes(MANIFEST_NAME, manifest.canonical_json())
    except BaseExceptionGroup as eg:
        raise first_error(eg) from None
    finally:
        await origin.aclose()
    return manifest
