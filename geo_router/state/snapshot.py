"""The routing-table snapshot on disk: written atomically, read back after a restart."""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ValidationError

from meridian.atomic_file import write_atomic
from meridian.contracts import RoutingTable

log = logging.getLogger(__name__)


def write_snapshot(path: Path, table: RoutingTable) -> None:
    """Persist `table` so that a reader sees either the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, table.model_dump_json().encode("utf-8"))


def read_snapshot(path: Path) -> RoutingTable | None:
    """The table saved at `path`, or None when there is none or it cannot be used."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read routing-table snapshot %s: %s", path, exc)
        return None
    try:
        return RoutingTable.model_validate_json(data)
    except ValidationError as exc:
        log.warning("ignoring unusable routing-table snapshot %s: %s", path, exc.errors()[:1])
        return None
