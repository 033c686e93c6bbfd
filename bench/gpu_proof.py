"""One prepared GPU proof (issue 38): every figure that needs a GPU, in one bounded run, into
one folder.

    python -m bench.gpu_proof [--out DIR] [--budget S] [--only STEP,...] [--wheelhouse DIR]
    python -m bench.gpu_proof --dry-run [--out DIR]

Why a prepared script: Meridian's production path is vLLM on GPUs, but a GPU machine is lent
to this work only now and then, for about 15 minutes from a cold start. An improvised run
would spend them on set-up and typos; this one is tested on every CI run (`--dry-run`) and
fits in `--budget` seconds (8 minutes by default) of the GPU's time.

On a machine whose torch sees a CUDA device it runs these steps in order, each in a process
of its own with a time cap; a step that does not fit in what is left of the budget is
skipped and the summary says so (the order is the order of value: vLLM's figures first,
then the torch engine's):

| step | what it measures | cap |
| --- | --- | --- |
| vllm | installs vLLM's GPU build (requirements-vllm-gpu.txt, pinned) into .venv-vllm, from the package registry or `--wheelhouse` | 180 s |
| routing_vllm | bench.routing_vllm on four vLLM GPU nodes: precise vs approximate KV-aware routing vs round robin | 150 s |
| pd_vllm | bench.pd with vLLM's NIXL connector on the GPU: decode ITL p95, long-prompt TTFT, throughput | 150 s |
| engine | bench.engine --device cuda: the torch engine's batching, chunked prefill and prefix cache | 60 s |
| weights_load | bench.weights_load --device cuda: the streaming loader and the host-to-device copy | 40 s |
| pd | bench.pd on torch-engine GPU nodes | 75 s |
| routing | bench.routing on torch-engine GPU nodes, a model whose prefill costs the GPU time | 90 s |
| migration | bench.migration on torch-engine GPU nodes: broken streams, token mismatches, resume p99 | 75 s |
| flow_control | noisy neighbour, band 5 and the engines' floor on GPU nodes (the ratios issue 37 could not meet on two CPU cores) | 90 s |

The vLLM steps are skipped at once when the install step fails (a machine that reaches no
package registry and was given no wheelhouse: the summary says why). On such a machine
Meridian's own install travels as wheels too: bench.gpu_kit writes them, and says how the
run begins. The torch-engine
nodes run on the GPU through `MERIDIAN_NODE_DEVICE=cuda`, which the local fabric passes to
every node.

What it leaves in the output folder (`--out`; three files, so that a device run brings
everything back): `figures.jsonl`, every bench's JSON lines with `gpu` (the device's name)
and `step` added to each; `summary.md`, a table of the steps (status, seconds, figures) and
one of the figures; `proof.log`, every step's progress, prefixed with its name. Progress
also goes to stderr as it happens.

Without a CUDA device it refuses in one line (exit status 2). `--dry-run` runs the same
steps on the CPU instead: vLLM's CPU build from `make vllm` (the install step checks it is
there rather than installing), the tiny model, every bench at its smallest (8.6 min on two
cores). `make bench` runs it and fails when a step fails, so the script cannot rot between
GPUs; CI runs its decisions (tests/unit/bench/test_bench_gpu_proof.py) but not the dry run
itself: beside the chaos drills on CI's two cores each half of it took 5 minutes, past
pytest's limit, and the drills beside it flaked. `--only` runs the steps named and no
others: a vLLM step without `vllm` beside it is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import IO, TYPE_CHECKING

from bench.common import Figure

if TYPE_CHECKING:  # the steps import the benches (torch and all) in their own processes only
    from data_plane.model.make_tiny import TinyArch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET_S = 480.0
DRY_RUN_BUDGET_S = 1800.0  # the dry run: every step on two CPU cores took 8.6 min
DRY_RUN_GPU = "none (dry run on the CPU)"
# A step that times out is asked to stop (SIGINT: its fabric stops its processes) and killed
# this long after.
STOP_GRACE_S = 15.0


class Size(StrEnum):
    """How big each bench runs: on the GPU, or at its smallest on the CPU (the dry run)."""

    GPU = "gpu"
    DRY = "dry"


class Status(StrEnum):
    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    what: str
    cap_s: float  # at most this long on the GPU (the dry run is not capped per step)
    needs_vllm: bool = False


STEPS = (
    Step("vllm", "vLLM's GPU build installed into .venv-vllm (pinned)", 180),
    Step("routing_vllm", "precise vs approximate KV-aware routing vs round robin, vLLM nodes", 150, True),
    Step("pd_vllm", "P/D with vLLM's NIXL connector vs co-located, vLLM nodes", 150, True),
    Step("engine", "the torch engine: batching, chunked prefill, prefix cache", 60),
    Step("weights_load", "the streaming loader and the host-to-device copy", 40),
    Step("pd", "P/D vs co-located, torch-engine nodes", 75),
    Step("routing", "KV-aware routing vs round robin, torch-engine nodes", 90),
    Step("migration", "streams resumed while their nodes are SIGKILLed, torch-engine nodes", 75),
    Step("flow_control", "noisy neighbour, band 5 and the engines' floor under saturation", 90),
)
STEP_NAMES = tuple(s.name for s in STEPS)


@dataclass(slots=True)
class Outcome:
    step: str
    status: Status
    seconds: float = 0.0
    figures: int = 0
    note: str = ""


@dataclass(slots=True)
class Proof:
    """One run's settings and what it has found so far."""

    out: Path
    size: Size
    gpu: str
    budget_s: float
    wheelhouse: Path | None = None
    started: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    vllm_ready: bool = False

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


def log(msg: str) -> None:
    print(f"[bench.gpu_proof] {msg}", file=sys.stderr, flush=True)


def detect_gpu() -> str | None:
    """The name of the CUDA device torch sees (None: none)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(0))


def timeout_for(step: Step, left_s: float, size: Size) -> float | None:
    """How long `step` may run with `left_s` of the budget left (None: skip it). On the GPU a
    step runs only with at least half its cap left, cut to what is left; the dry run's steps
    share its whole budget."""
    if size is Size.DRY:
        return left_s if left_s > 0 else None
    if left_s < step.cap_s / 2:
        return None
    return min(step.cap_s, left_s)


def tagged(line: str, gpu: str, step: str) -> str | None:
    """A bench's JSON line with the GPU and the step added (None: not a figure's line)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or "metric" not in record:
        return None
    return json.dumps({**record, "gpu": gpu, "step": step})


# --- the steps' measurements (each runs in a process of its own: `--step NAME`) ------------


def _engine(size: Size, tmp: Path) -> list[Figure]:
    from bench import engine

    if size is Size.GPU:
        return engine.run(device="cuda")
    small = engine.Workload(prompt_len=(8, 32), new_tokens=(4, 8), throughput_repeats=1, itl_decodes=2,
                            itl_long_prompt_len=256, itl_long_prompts=1, itl_long_in_flight=1,
                            itl_chunk_tokens=64, ttft_prompt_len=128, ttft_repeats=2)
    return engine.run(work=small)


def _weights_load(size: Size, tmp: Path) -> list[Figure]:
    from bench import weights_load

    if size is Size.GPU:
        return weights_load.run(tmp, device="cuda")
    return weights_load.run(tmp, work=weights_load.Workload(hidden=256, intermediate=704, layers=1, vocab=4000,
                                                            repeats=3))


def _pd(engine_name: str) -> Callable[[Size, Path], list[Figure]]:
    def measure(size: Size, tmp: Path) -> list[Figure]:
        from bench import pd

        if size is Size.GPU:
            return pd.run(seconds=20.0, decoders=8, long_rate=2.0, engine=engine_name, device="cuda")
        # 4 s: in 2 s, vLLM's CPU build ended the window before a disaggregated request did.
        return pd.run(seconds=4.0, decoders=2, long_rate=1.0, long_words=300, max_tokens=16, engine=engine_name)
    return measure


def _gpu_arch() -> TinyArch:
    """A model whose prefill costs an H100-class GPU real time (about 0.7 B parameters,
    head_dim 64 as vLLM wants), generated: nothing is downloaded."""
    from data_plane.model.make_tiny import TinyArch

    return TinyArch(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=5632, max_position_embeddings=4096)


def _routing(size: Size, tmp: Path) -> list[Figure]:
    from bench import routing

    if size is Size.GPU:
        return routing.run(workload=replace(routing.QUICK, arch=_gpu_arch()))
    small = replace(routing.QUICK, nodes=2, users=2, conversations=2, turns=2, think_s=0.2, unique_requests=4)
    return routing.run(workload=small, only=frozenset({"rr", "aff"}))


def _routing_vllm(size: Size, tmp: Path) -> list[Figure]:
    from bench import routing_vllm

    if size is Size.GPU:
        return routing_vllm.run(workload=replace(routing_vllm.QUICK, arch=_gpu_arch()), device="cuda")
    # One vLLM node: each costs CI's two cores about a minute to start.
    return routing_vllm.run(workload=replace(routing_vllm.QUICK, nodes=1, users=2, conversations=2, turns=2,
                                             think_s=0.2))


def _migration(size: Size, tmp: Path) -> list[Figure]:
    from bench import migration

    if size is Size.GPU:
        return migration.run()
    return migration.run(concurrency=2, seconds=3.0, kill_every_s=1.5, restart_after_s=0.5, max_tokens=40)


def _flow_control(size: Size, tmp: Path) -> list[Figure]:
    from bench import flow_control

    runs = frozenset({"alone", "flood", "full", "urgent"})
    if size is Size.GPU:
        return flow_control.run(flow_control.Load(seconds=10.0, warmup_s=4.0), runs)
    small = flow_control.Load(slots=4, seconds=2.0, warmup_s=1.0, light_users=1, flood_words=40, flood_tokens=16)
    return flow_control.run(small, runs)


MEASURES: dict[str, Callable[[Size, Path], list[Figure]]] = {
    "engine": _engine,
    "weights_load": _weights_load,
    "pd": _pd("torch"),
    "pd_vllm": _pd("vllm"),
    "routing": _routing,
    "routing_vllm": _routing_vllm,
    "migration": _migration,
    "flow_control": _flow_control,
}


def measure_step(name: str, size: Size) -> None:
    """Inside a step's own process: its bench's figures, JSON lines on stdout."""
    with tempfile.TemporaryDirectory(prefix=f"meridian-gpu-proof-{name}-") as tmp:
        for fig in MEASURES[name](size, Path(tmp)):
            print(fig.json_line(), flush=True)


# --- the orchestration -------------------------------------------------------------------


def vllm_python() -> Path:
    return ROOT / ".venv-vllm" / "bin" / "python"


def _vllm_imports(python: Path, timeout_s: float) -> bool:
    if not python.is_file():
        return False
    try:
        return subprocess.run([str(python), "-c", "import vllm"], capture_output=True,
                              timeout=timeout_s).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def install_command(proof: Proof) -> list[list[str]]:
    """The commands that put vLLM's GPU build into .venv-vllm: from the package registry, or
    only from `--wheelhouse` when one is given (a machine that reaches no registry)."""
    venv = ROOT / ".venv-vllm"
    source = ["--no-index", "--find-links", str(proof.wheelhouse)] if proof.wheelhouse else ["--retries", "1",
                                                                                             "--timeout", "15"]
    return [[sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input", *source,
             "-r", str(ROOT / "requirements-vllm-gpu.txt")]]


def prepare_vllm(proof: Proof, timeout_s: float) -> Outcome:
    """The vllm step: on the GPU, vLLM's GPU build in .venv-vllm (installed unless there);
    in the dry run, the CPU build `make vllm` installed, checked, not installed."""
    started = time.monotonic()
    if _vllm_imports(vllm_python(), timeout_s):
        proof.vllm_ready = True
        return Outcome("vllm", Status.OK, time.monotonic() - started, note="already in .venv-vllm")
    if proof.size is Size.DRY:
        return Outcome("vllm", Status.FAILED, time.monotonic() - started, note="no vLLM in .venv-vllm: `make vllm`")
    for argv in install_command(proof):
        left = timeout_s - (time.monotonic() - started)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            return Outcome("vllm", Status.TIMED_OUT, time.monotonic() - started, note=f"{argv[2]} ran past the cap")
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
            return Outcome("vllm", Status.FAILED, time.monotonic() - started, note=last)
    proof.vllm_ready = _vllm_imports(vllm_python(), 120.0)
    status = Status.OK if proof.vllm_ready else Status.FAILED
    return Outcome("vllm", status, time.monotonic() - started, note="" if proof.vllm_ready else "installed, no import")


def _stop(process: subprocess.Popen[str]) -> None:
    """A step past its time: SIGINT to its process group (its fabric stops what it started),
    then SIGKILL."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def run_step(proof: Proof, step: Step, timeout_s: float) -> Outcome:
    """One bench in a process of its own, its figures tagged into figures.jsonl and its
    progress into proof.log (and stderr)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if proof.size is Size.GPU:
        env["MERIDIAN_NODE_DEVICE"] = "cuda"  # every torch-engine node of the step's fabric
    argv = [sys.executable, "-m", "bench.gpu_proof", "--step", step.name, "--size", proof.size.value]
    started = time.monotonic()
    with (proof.out / "proof.log").open("a") as logfile, tempfile.TemporaryFile("w+") as stdout:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        relay = threading.Thread(target=_relay, args=(process.stderr, logfile, step.name), daemon=True)
        relay.start()
        try:
            status = Status.OK if process.wait(timeout=timeout_s) == 0 else Status.FAILED
        except subprocess.TimeoutExpired:
            _stop(process)
            status = Status.TIMED_OUT
        relay.join(timeout=5.0)
        stdout.seek(0)
        lines = [t for line in stdout if (t := tagged(line, proof.gpu, step.name)) is not None]
    with (proof.out / "figures.jsonl").open("a") as figures:
        figures.writelines(line + "\n" for line in lines)
    note = {Status.OK: "", Status.TIMED_OUT: f"stopped at its cap of {timeout_s:.0f} s"}.get(
        status, f"exit status {process.returncode}")
    return Outcome(step.name, status, time.monotonic() - started, len(lines), note)


def _relay(stream: IO[str], logfile: IO[str], name: str) -> None:
    """The step's stderr, each line prefixed with its name, to proof.log and stderr."""
    for line in stream:
        out = f"[{name}] {line.rstrip()}"
        print(out, file=sys.stderr, flush=True)
        print(out, file=logfile, flush=True)


def summary_markdown(proof: Proof, figure_lines: list[str]) -> str:
    """summary.md: what ran on which GPU, step by step, and every figure."""
    lines = [f"# GPU proof: {proof.gpu}", "",
             f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC · size `{proof.size.value}` · budget {proof.budget_s:.0f} s, "
             f"used {proof.budget_s - proof.left_s():.0f} s", "",
             "| step | status | seconds | figures | note |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {o.step} | {o.status.value} | {o.seconds:.0f} | {o.figures} | {o.note} |" for o in proof.outcomes]
    lines += ["", "| step | figure | ours | baseline | ratio | goal |", "| --- | --- | --- | --- | --- | --- |"]
    for raw in figure_lines:
        f = json.loads(raw)
        lines.append(f"| {f['step']} | `{f['metric']}` | {f['ours']} {f['unit']} | {f['baseline']} "
                     f"({f['baseline_name']}) | {f['ratio']} | {f['goal']} |")
    return "\n".join(lines) + "\n"


def prove(proof: Proof, only: frozenset[str] | None = None) -> int:
    """Every step in order within the budget; 0 when every step that ran passed."""
    proof.out.mkdir(parents=True, exist_ok=True)
    for name in ("figures.jsonl", "proof.log"):
        (proof.out / name).write_text("")
    steps = [s for s in STEPS if only is None or s.name in only]
    for i, step in enumerate(steps, 1):
        outcome = _one(proof, step)
        proof.outcomes.append(outcome)
        log(f"step {i}/{len(steps)} {step.name}: {outcome.status.value} in {outcome.seconds:.0f} s, "
            f"{outcome.figures} figures{f' ({outcome.note})' if outcome.note else ''}; {proof.left_s():.0f} s left")
    figure_lines = (proof.out / "figures.jsonl").read_text().splitlines()
    (proof.out / "summary.md").write_text(summary_markdown(proof, figure_lines))
    log(f"{len(figure_lines)} figures in {proof.out}/figures.jsonl; summary in {proof.out}/summary.md")
    failed = [o for o in proof.outcomes if o.status in (Status.FAILED, Status.TIMED_OUT)]
    return 1 if failed else 0


def _one(proof: Proof, step: Step) -> Outcome:
    if step.needs_vllm and not proof.vllm_ready:
        return Outcome(step.name, Status.SKIPPED, note="no vLLM (the vllm step did not pass)")
    timeout_s = timeout_for(step, proof.left_s(), proof.size)
    if timeout_s is None:
        return Outcome(step.name, Status.SKIPPED, note=f"budget: {max(0.0, proof.left_s()):.0f} s left")
    log(f"{step.name}: {step.what} (at most {timeout_s:.0f} s)")
    if step.name == "vllm":
        return prepare_vllm(proof, timeout_s)
    return run_step(proof, step, timeout_s)


def dry_run(out: Path) -> int:
    """Every step on the CPU at its smallest, into `out` (`make bench` runs it): 0 when all passed."""
    return prove(Proof(out, Size.DRY, DRY_RUN_GPU, DRY_RUN_BUDGET_S))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="the output folder (default gpu-proof-<UTC time>)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for every step together (default {DEFAULT_BUDGET_S:.0f}; dry run {DRY_RUN_BUDGET_S:.0f})")
    ap.add_argument("--only", default=None, help=f"these steps only ({', '.join(STEP_NAMES)})")
    ap.add_argument("--wheelhouse", type=Path, default=None, help="install vLLM from this folder of wheels only")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, at their smallest")
    ap.add_argument("--step", choices=tuple(MEASURES), help=argparse.SUPPRESS)  # one step's own process
    ap.add_argument("--size", choices=tuple(Size), default=Size.GPU.value, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        measure_step(args.step, Size(args.size))
        return
    gpu = DRY_RUN_GPU if args.dry_run else detect_gpu()
    if gpu is None:
        print("bench.gpu_proof: no CUDA device here (torch sees none); --dry-run runs the same steps on the CPU",
              file=sys.stderr)
        raise SystemExit(2)
    size = Size.DRY if args.dry_run else Size.GPU
    budget = args.budget if args.budget is not None else (DRY_RUN_BUDGET_S if args.dry_run else DEFAULT_BUDGET_S)
    only = frozenset(args.only.split(",")) if args.only else None
    if only is not None and not only <= set(STEP_NAMES):
        ap.error(f"--only: unknown steps {sorted(only - set(STEP_NAMES))}")
    out = args.out or Path(f"gpu-proof-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
    log(f"GPU: {gpu}; {len(only or STEP_NAMES)} steps in at most {budget:.0f} s; output in {out}")
    raise SystemExit(prove(Proof(out, size, gpu, budget, args.wheelhouse), only))


if __name__ == "__main__":
    main()
