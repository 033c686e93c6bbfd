"""Shared output format of every benchmark (see DESIGN.md, "Benchmark output")."""

from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Figure:
    """One measured figure: ours against a baseline measured in the same run."""

    bench: str
    metric: str
    ours: float
    baseline: float
    baseline_name: str
    goal: str
    unit: str

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("inf")

    def json_line(self) -> str:
        d = asdict(self)
        # A zero baseline (e.g. "lost requests") has no ratio; JSON has no Infinity.
        d["ratio"] = round(self.ratio, 4) if self.baseline else None
        d["ours"], d["baseline"] = round(self.ours, 4), round(self.baseline, 4)
        return json.dumps(d)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`: a bench's helper process, stopped either way."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)
