"""The neighbour's process: keep-alive GETs on a fixed schedule, each timed from when it was due.

Contract: `python chaos/attacks/probe.py HOST PORT PROBES_JSON` prints "ready", then sends
the probes (path and headers, taken in turn) at RATE_HZ on one keep-alive HTTP/1.1
connection until its stdin closes, then prints every request's sample (when it was due on
the machine's monotonic clock, milliseconds from then until answered, answered 200 or not)
as one JSON line. chaos.attacks.neighbour starts it and reads it.

Why run by path, with the standard library only: it starts in a fraction of a second and
imports nothing of the package it serves (which pulls in the fabric, websockets and h2).
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

RATE_HZ = 100.0
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Probe:
    path: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Sample:
    due: float
    ms: float
    ok: bool


def _one(conn: http.client.HTTPConnection, probe: Probe) -> bool:
    conn.request("GET", probe.path, headers=dict(probe.headers))
    response = conn.getresponse()
    response.read()
    return response.status == 200


def probe_loop(host: str, port: int, probes: Sequence[Probe], stop: threading.Event) -> list[Sample]:
    """Send `probes` in turn at RATE_HZ until `stop`; every request's sample."""
    samples: list[Sample] = []
    conn: http.client.HTTPConnection | None = None
    interval = 1.0 / RATE_HZ
    due = time.monotonic()
    i = 0
    while not stop.is_set():
        ok = False
        try:
            if conn is None:
                conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
            ok = _one(conn, probes[i % len(probes)])
        except (OSError, http.client.HTTPException):
            if conn is not None:
                conn.close()
            conn = None
        samples.append(Sample(due, (time.monotonic() - due) * 1000, ok))
        i += 1
        due += interval
        # Behind schedule: the next request goes at once, still timed from when it was due.
        stop.wait(max(0.0, due - time.monotonic()))
    if conn is not None:
        conn.close()
    return samples


def main() -> None:  # pragma: no cover - the child process
    """The process: see the module's contract."""
    host, port, probes_json = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    probes = [Probe(p["path"], tuple((k, v) for k, v in p["headers"])) for p in json.loads(probes_json)]
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    samples = probe_loop(host, port, probes, stop)
    print(json.dumps([[s.due, s.ms, s.ok] for s in samples]), flush=True)


if __name__ == "__main__":
    main()
