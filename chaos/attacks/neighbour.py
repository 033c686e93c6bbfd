"""The well-behaved tenant next to an attack: keep-alive GETs on a fixed schedule, timed.

Contract: `Neighbour(listener, probes)` starts a process of its own (chaos/attacks/probe.py)
that sends `probes` (path and headers, taken in turn) to the listener at probe.RATE_HZ on
one keep-alive HTTP/1.1 connection until the context exits, and then hands back every
request's `Sample`: when it was due (on the machine's monotonic clock, which every process
shares), how long from then until it was answered, and whether it was answered 200.
`window(samples, start, end)` summarises those due in a time window (p50, p99, failures).

Why a process of its own: the attack's client runs on the runner's event loop; a neighbour
in the same process would wait on that loop (or the GIL) and charge the attacker's client
time to the server. Why timed from when due (open loop on one connection): a server that
stalls for two seconds delays every request due in those two seconds, and a closed-loop
client that waits would record that as one slow sample. A request not answered within
probe.TIMEOUT_S fails, and the next one opens a new connection.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from chaos.attacks import probe
from chaos.attacks.probe import Probe, Sample
from chaos.attacks.target import Listener
from chaos.checker import percentile

# The child imports the standard library only, but start-up can take seconds on a loaded
# two-core machine.
START_TIMEOUT_S = 30.0

__all__ = ["Neighbour", "Probe", "Sample", "Window", "window"]


@dataclass(frozen=True)
class Window:
    requests: int
    failed: int
    p50_ms: float
    p99_ms: float


def window(samples: Sequence[Sample], start: float, end: float) -> Window:
    """The requests due in [start, end): how many, how many failed, their p50 and p99."""
    inside = [s for s in samples if start <= s.due < end]
    ms = [s.ms for s in inside]
    return Window(len(inside), sum(not s.ok for s in inside),
                  percentile(ms, 50) or float("nan"), percentile(ms, 99) or float("nan"))


class Neighbour:
    """A context manager: the neighbour's process runs inside it; `samples` after exit."""

    def __init__(self, listener: Listener, probes: Sequence[Probe]) -> None:
        spec = json.dumps([{"path": p.path, "headers": list(p.headers)} for p in probes])
        # -I: nothing but the standard library on its path (not this directory, whose modules
        # have names of their own).
        self._args = [sys.executable, "-I", str(probe.__file__), listener.host, str(listener.port), spec]
        self._process: subprocess.Popen[str] | None = None
        self.samples: list[Sample] = []

    def __enter__(self) -> Neighbour:
        self._process = subprocess.Popen(self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], START_TIMEOUT_S)
        if not ready or self._process.stdout.readline().strip() != "ready":
            self._process.kill()
            self._process.wait()
            raise RuntimeError("the neighbour process did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None
        try:
            out, _ = self._process.communicate(timeout=probe.TIMEOUT_S + 10)
            self.samples = [Sample(*s) for s in json.loads(out)] if out.strip() else []
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
