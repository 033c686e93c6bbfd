"""Request journals: append-only JSON lines of what a router routed and a node served.

A request is identified by its idempotency key (the client's `Idempotency-Key`, else its
`x-request-id`). With a journal path set, a router appends a `routed` line for every attempt
it sends to a node and a node appends a `served` line when it stops working on a request,
so that a drill's checker can join them with the client's own record (chaos.history reads
these lines). Off by default; an audit trail for drills and incident reviews, not a log.

Each line goes to the kernel in one unbuffered write() with its newline, so a process
killed with SIGKILL loses at most the line it was writing, and the file is opened once:
appending ~100 bytes to the page cache costs microseconds on the event loop.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

# Header carrying the idempotency key; the router forwards the key to nodes as x-request-id.
HEADER_IDEMPOTENCY_KEY = "idempotency-key"


class JsonLinesFile:
    """An append-only JSON-lines file, one unbuffered write per line.

    A torn last line left by a crash is cut off before appending: a new record glued onto
    it would turn a forgivable torn tail into a corrupt line in the middle of the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_torn_tail(self.path)
        self._file = open(self.path, "ab", buffering=0)  # closed in close()
        # Threads of one process (the local scaler, a test) may share a journal.
        self._lock = threading.Lock()

    def append(self, data: dict[str, object]) -> None:
        """Append one JSON object as a line."""
        line = (json.dumps(data, separators=(",", ":")) + "\n").encode("utf-8")
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonLinesFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def drop_torn_tail(path: Path) -> None:
    """Cut a JSON-lines file back to its last newline (a crashed writer's torn line)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        log.warning("%s: dropping a torn last line of %d bytes before appending", path, len(data) - keep)
        f.truncate(keep)
        os.fsync(f.fileno())


class RequestJournal:
    """`routed` and `served` records of one process; a no-op without a path."""

    def __init__(self, path: str | Path | None) -> None:
        self._file = JsonLinesFile(path) if path is not None else None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def routed(self, key: str, node: str, region: str, attempt: int, *, migration: int = 0,
               resume_tokens: int = 0) -> None:
        """A router sent attempt number `attempt` (from 1) of request `key` to `node`; a
        migrated stream's continuation number `migration` (from 1) says so, with how many
        generated tokens the client had been sent before it."""
        if self._file is not None:
            line: dict[str, object] = {"type": "routed", "key": key, "node": node, "region": region,
                                       "attempt": attempt}
            if migration:
                line.update(migration=migration, resume_tokens=resume_tokens)
            self._file.append(line)

    def served(self, key: str, node: str, completed: bool, *, prefill: bool = False) -> None:
        """A node stopped working on `key`: at its end (`completed`) or before it. `prefill`:
        the node only prefilled the request for a decode worker (a P/D hand-off), which
        serves it; such a line is not the request's answer."""
        if self._file is not None:
            line: dict[str, object] = {"type": "served", "key": key, "node": node, "completed": completed}
            if prefill:
                line["prefill"] = True
            self._file.append(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
