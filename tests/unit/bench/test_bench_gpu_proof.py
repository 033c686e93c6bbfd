"""bench.gpu_proof's decisions, without a GPU: what fits in the budget, how figures are
tagged with the GPU, what the summary says, and the one-line refusal on a machine without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import Figure
from bench.gpu_proof import (
    ROOT,
    STEPS,
    Outcome,
    Proof,
    Size,
    Status,
    Step,
    install_command,
    prove,
    summary_markdown,
    tagged,
    timeout_for,
)

STEP = Step("routing", "KV-aware routing", 90)


def test_a_gpu_step_runs_only_with_half_its_cap_left_and_never_past_the_budget() -> None:
    assert timeout_for(STEP, 400, Size.GPU) == 90
    assert timeout_for(STEP, 60, Size.GPU) == 60  # cut to what is left
    assert timeout_for(STEP, 44, Size.GPU) is None  # under half its cap: skipped, said so
    # The dry run's steps share its whole budget (CI's box is slower than any GPU's host).
    assert timeout_for(STEP, 1000, Size.DRY) == 1000
    assert timeout_for(STEP, 0, Size.DRY) is None


def test_every_figure_names_the_gpu_and_the_step_and_other_lines_are_left_out() -> None:
    line = Figure("pd", "itl_p95_pd_vs_colocated", 10.0, 20.0, "co-located", "ratio <= 0.8", "ms").json_line()
    record = json.loads(tagged(line, "NVIDIA H200", "pd_vllm") or "{}")
    assert (record["gpu"], record["step"], record["metric"], record["ratio"]) == (
        "NVIDIA H200", "pd_vllm", "itl_p95_pd_vs_colocated", 0.5)
    assert tagged("[bench.pd] warming up", "NVIDIA H200", "pd") is None
    assert tagged('["not", "a figure"]', "NVIDIA H200", "pd") is None


def test_the_vllm_install_goes_to_the_wheelhouse_alone_when_given_one(tmp_path: Path) -> None:
    proof = Proof(tmp_path, Size.GPU, "NVIDIA H200", 480, wheelhouse=tmp_path / "wheels")
    pip = install_command(proof)[-1]
    assert ["--no-index", "--find-links", str(tmp_path / "wheels")] == pip[pip.index("--no-index"):][:3]
    assert pip[-2:] == ["-r", str(ROOT / "requirements-vllm-gpu.txt")]
    assert "vllm==" in (ROOT / "requirements-vllm-gpu.txt").read_text()  # pinned
    registry = install_command(Proof(tmp_path, Size.GPU, "NVIDIA H200", 480))[-1]
    assert "--no-index" not in registry


def test_vllm_steps_are_skipped_with_the_reason_when_vllm_is_not_there(tmp_path: Path) -> None:
    proof = Proof(tmp_path / "out", Size.GPU, "NVIDIA H200", 480)
    assert prove(proof, frozenset({"routing_vllm", "pd_vllm"})) == 0  # skipped is not failed
    assert [(o.step, o.status) for o in proof.outcomes] == [("routing_vllm", Status.SKIPPED),
                                                            ("pd_vllm", Status.SKIPPED)]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "# GPU proof: NVIDIA H200" in summary
    assert "| routing_vllm | skipped | 0 | 0 | no vLLM (the vllm step did not pass) |" in summary
    assert (tmp_path / "out" / "figures.jsonl").read_text() == ""


def test_the_summary_has_a_row_per_step_and_per_figure(tmp_path: Path) -> None:
    proof = Proof(tmp_path, Size.GPU, "NVIDIA H200", 480)
    proof.outcomes = [Outcome("engine", Status.OK, 41.0, 1), Outcome("routing", Status.TIMED_OUT, 90.0, 0,
                                                                       "stopped at its cap of 90 s")]
    fig = tagged(Figure("engine", "throughput_vs_batch1", 900.0, 100.0, "max_num_seqs=1", "ratio >= 4",
                        "tokens/s").json_line(), "NVIDIA H200", "engine")
    summary = summary_markdown(proof, [fig or ""])
    assert "| engine | ok | 41 | 1 |  |" in summary
    assert "| routing | timed out | 90 | 0 | stopped at its cap of 90 s |" in summary
    assert "| engine | `throughput_vs_batch1` | 900.0 tokens/s | 100.0 (max_num_seqs=1) | 9.0 | ratio >= 4 |" in summary


def test_the_steps_come_in_the_order_of_value_and_fit_the_budget_without_vllm() -> None:
    names = [s.name for s in STEPS]
    assert names[:3] == ["vllm", "routing_vllm", "pd_vllm"]
    # With no vLLM to install (a machine that reaches no registry), the torch-engine steps
    # all fit in the default 8 minutes.
    assert sum(s.cap_s for s in STEPS if s.name != "vllm" and not s.needs_vllm) <= 480


def test_without_a_gpu_it_refuses_in_one_line() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")  # CI's never does
    done = subprocess.run([sys.executable, "-m", "bench.gpu_proof"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "no CUDA device" in done.stderr and "--dry-run" in done.stderr
