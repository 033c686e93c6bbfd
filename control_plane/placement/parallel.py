"""Independent MILPs on a few threads at once.

HiGHS releases the GIL while it solves, so per-deployment models solved on threads use the
cores (model building and reading stay serial under the GIL, a few milliseconds each). Threads
rather than processes: the models and plans need no pickling, and HiGHS's one process-wide
scheduler is shared. Results keep the input order, whatever order the solves finish in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """[fn(x) for x in items] on `workers` threads; the first exception is raised once the calls
    already running have returned (the ones not yet started are cancelled)."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="placement")
    try:
        return list(pool.map(fn, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
