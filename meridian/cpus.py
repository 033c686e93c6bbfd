"""How many CPUs this process may run on: its affinity mask (a container's cpuset, `taskset`),
not the host's count, which over-counts wherever a process is pinned or confined."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(requested: int) -> int:
    """`requested` processes, or with 0 one per usable CPU (a router's `--workers`)."""
    return requested if requested > 0 else usable_cpus()
