"""The GPU proof's dry run, its torch-engine steps (issue 38): each bench the script runs on a
GPU's torch-engine nodes, at its smallest on the CPU (the vLLM steps: test_vllm_gpu_proof.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_proof_check import check_dry_run

from bench.gpu_proof import STEPS

# Minutes on CI's loaded box (pytest's default is 5); the dry run's own timeout (1500 s) fires first.
pytestmark = pytest.mark.timeout(1600)


def test_the_dry_run_of_the_torch_engine_steps_leaves_tagged_figures_and_a_summary(tmp_path: Path) -> None:
    steps = [s.name for s in STEPS if s.name != "vllm" and not s.needs_vllm]
    assert steps == ["engine", "weights_load", "pd", "routing", "migration", "flow_control"]
    check_dry_run(tmp_path / "proof", steps)
