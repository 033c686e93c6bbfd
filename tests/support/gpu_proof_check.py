"""The GPU proof's dry run, checked (issue 38): `python -m bench.gpu_proof --dry-run` over some
of its steps, and what a run must leave behind. Two test modules split the steps between them:
the vLLM ones run in the heavy group (tests/conftest.py), the torch-engine ones beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu_proof import DRY_RUN_GPU, ROOT


def check_dry_run(out: Path, steps: list[str]) -> None:
    """Run the dry run of `steps` into `out`; every step passed, every figure is tagged."""
    done = subprocess.run([sys.executable, "-m", "bench.gpu_proof", "--dry-run", "--only", ",".join(steps),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["figures.jsonl", "proof.log", "summary.md"]

    measured = [name for name in steps if name != "vllm"]  # the install step leaves no figure
    figures = [json.loads(line) for line in (out / "figures.jsonl").read_text().splitlines()]
    assert {f["gpu"] for f in figures} == {DRY_RUN_GPU}
    assert {f["step"] for f in figures} == set(measured)
    assert all({"metric", "ours", "baseline", "goal", "unit"} <= f.keys() for f in figures)

    summary = (out / "summary.md").read_text()
    for name in steps:
        assert f"| {name} | ok |" in summary, summary
    log = (out / "proof.log").read_text()
    assert all(f"[{name}] " in log for name in measured)  # each step's progress, prefixed
    assert all(f"{name}: ok in" in done.stderr for name in steps)  # progress as it happens
