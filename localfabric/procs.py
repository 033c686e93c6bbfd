"""Child processes of the local fabric: free or preferred ports, niceness, and a death
signal so that no child outlives the launcher."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
from pathlib import Path

from meridian.ports import free_port

_PR_SET_PDEATHSIG = 1


def port_or_free(preferred: int | None, host: str) -> int:
    if preferred:
        with socket.socket() as s:
            try:
                s.bind((host, preferred))
                return preferred
            except OSError:
                pass
    return free_port(host)


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # A child must not outlive the launcher, even when the launcher is SIGKILLed.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def renice(pid: int, niceness: int) -> None:
    """Set the niceness of every thread of a process (Linux keeps it per thread)."""
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [pid]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
