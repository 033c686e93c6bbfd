"""The GPU proof's dry run, its vLLM steps (issue 38): vLLM's CPU build from `make vllm` checked,
routing_vllm and P/D through vLLM's NIXL connector at their smallest, so that the script a GPU
machine will run has run on every CI run. Named test_vllm_*: it runs in the heavy group."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_proof_check import check_dry_run

# Minutes on CI's loaded box (pytest's default is 5); the dry run's own timeout (1500 s) fires first.
pytestmark = pytest.mark.timeout(1600)


def test_the_dry_run_of_the_vllm_steps_leaves_tagged_figures_and_a_summary(tmp_path: Path) -> None:
    check_dry_run(tmp_path / "proof", ["vllm", "routing_vllm", "pd_vllm"])
