"""Whole-file writes that a concurrent reader, or a crash mid-write, never sees half done.

The data goes to a temporary file in the target's directory (so the final step is a rename
on one filesystem), is flushed and fsynced, then `os.replace`d over the target: a reader
opens either the old file or the complete new one. On any failure, the temporary file is
removed and the old file stays as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically. `mode`: the file's permissions; None keeps
    mkstemp's private 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
