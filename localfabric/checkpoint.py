"""Whether the fabric's file:// weight origin already holds a push of a checkpoint directory.

The fabric pushes its checkpoint (the generated tiny one, or an operator's `--model-dir`) to
the origin once and reuses it on later starts; a directory whose files changed since (another
checkpoint under the same name) is pushed again. The origin's manifest lists every file with
its size; the same names and sizes are taken as the same push (hashing a real checkpoint on
every start would cost what the push costs). The file walk is `meridian model push`'s: hidden
files and the manifest itself are left out. Nothing of the data plane is imported: the
local fabric reaches the planes through the CLI only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST_NAME = "meridian-manifest.json"


def _local_files(model_dir: Path) -> set[tuple[str, int]]:
    files: set[tuple[str, int]] = set()
    for root, dirs, names in os.walk(model_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith(".") or name == MANIFEST_NAME:
                continue
            p = Path(root) / name
            files.add((p.relative_to(model_dir).as_posix(), p.stat().st_size))
    return files


def origin_holds(origin: Path, model_dir: Path) -> bool:
    """True when `origin` has a manifest listing exactly `model_dir`'s files and sizes, or has
    a manifest and `model_dir` is gone (a cached origin kept without its source)."""
    try:
        manifest = json.loads((origin / MANIFEST_NAME).read_text(encoding="utf-8"))
        pushed = {(f["path"], f["size"]) for f in manifest["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not model_dir.is_dir():
        return True
    try:
        return _local_files(model_dir) == pushed
    except OSError:
        return False
