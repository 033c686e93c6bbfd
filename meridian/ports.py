"""Free local TCP ports, for processes a component starts on this machine (a vLLM child,
the local fabric, test services)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
