"""Child processes of the local fabric: free or preferred ports, niceness, and a death
signal so that no child outlives the launcher.

The fabric's ports come from below the kernel's ephemeral range. A process the fabric
restarts (a node a drill crashed) gets its old port back, and a port in the ephemeral
range is any outbound connection's to take in between: the restarted node then fails
with EADDRINUSE (seen in CI's provider-outage drill). No outbound connection is ever
given a port below that range, so once handed out a port stays the fabric's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import threading
from pathlib import Path

from meridian.ports import free_port

_PR_SET_PDEATHSIG = 1


# Where the fabric's ports are drawn from: above the well-known and registered services
# people run on a development machine, below the ephemeral range (which starts at 32768
# by default).
_FIRST_PORT = 20000
_LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_handing = threading.Lock()


def port_or_free(preferred: int | None, host: str) -> int:
    if preferred and _bindable(host, preferred):
        return preferred
    return fabric_port(host)


def fabric_port(host: str) -> int:
    """A free port below the ephemeral range, not handed out before by this process (an
    ephemeral one from the kernel if none is found)."""
    end = _ephemeral_start()
    with _handing:
        for _ in range(500) if end - _FIRST_PORT > 1000 else ():
            port = random.randrange(_FIRST_PORT, end)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    return free_port(host)


def _ephemeral_start() -> int:
    try:
        return int(_LOCAL_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


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
