"""Weights load: our streaming safetensors loader against safetensors' own, and on CUDA against
the bare pinned host->device copy, side by side in one run on a generated two-shard checkpoint.

    python -m bench.weights_load [--full] [--device cpu|cuda]

Figures (bytes/s, ours / baseline, medians of alternating repetitions, page cache warm on both
sides: a node loads from its local cache):

- load_vs_safetensors_load_file: the shards into usable torch tensors on the device, every byte
  of every tensor then read once (a max over the tensor's bits), with
  `stream_tensors(files, device)` / with `safetensors.torch.load_file(file, device)` per shard.
- h2d_vs_pinned_copy (CUDA only): `stream_tensors(files, "cuda")` until the device holds every
  tensor / one `copy_` of the same number of bytes from an already-filled pinned host buffer into
  an already-allocated device buffer: how close loading gets to what the link can carry.

What safetensors.torch.load_file (0.8) does: on CPU it maps the whole file with
`torch.UntypedStorage.from_file(shared=False)` (a MAP_PRIVATE mmap) and returns zero-copy views
of it, so bytes are read only when touched, as ours are; the CPU figure therefore compares two
zero-copy mappings, and what differs is the per-tensor cost of building them. With a CUDA device
it copies each tensor, one at a time and on one thread, from the mapping into a freshly
allocated pinned tensor and then calls `.to("cuda")`, which waits for the transfer, so reading
and copying never overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file as safetensors_load_file
from safetensors.torch import save_file

from bench.common import Figure, median
from data_plane.model.safetensors_stream import stream_tensors

BENCH = "weights"
WARMUP = 3


@dataclass(frozen=True, slots=True)
class Workload:
    """A Llama-shaped checkpoint (fp16 embeddings, bf16 layers, fp32 norms) and repetitions."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    repeats: int


QUICK = Workload(hidden=1024, intermediate=2816, layers=2, vocab=16_000, repeats=51)  # ~110 MB
FULL = Workload(hidden=2048, intermediate=5632, layers=3, vocab=32_000, repeats=61)  # ~530 MB


def log(msg: str) -> None:
    print(f"[bench.weights_load] {msg}", file=sys.stderr, flush=True)


def resolve_device(requested: str) -> str:
    """`requested`, or "cpu" (said on stderr) when CUDA is asked for but absent."""
    if requested.startswith("cuda") and not torch.cuda.is_available():
        log(f"--device {requested}: CUDA is not available to torch {torch.__version__}; falling back to cpu")
        return "cpu"
    return requested


def make_shards(work_dir: Path, work: Workload, seed: int = 0) -> list[Path]:
    """Write the checkpoint as two shards: embeddings and the first half of the layers, then the rest."""
    gen = torch.Generator().manual_seed(seed)
    h, kv = work.hidden, work.hidden // 4

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    def layer(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        return {
            p + "input_layernorm.weight": rand(h, dtype=torch.float32),
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "post_attention_layernorm.weight": rand(h, dtype=torch.float32),
            p + "mlp.gate_proj.weight": rand(work.intermediate, h),
            p + "mlp.up_proj.weight": rand(work.intermediate, h),
            p + "mlp.down_proj.weight": rand(h, work.intermediate),
        }

    half = work.layers // 2
    first = {"model.embed_tokens.weight": rand(work.vocab, h, dtype=torch.float16)}
    second = {"model.norm.weight": rand(h, dtype=torch.float32),
              "lm_head.weight": rand(work.vocab, h, dtype=torch.float16)}
    for i in range(work.layers):
        (first if i < half else second).update(layer(i))
    files = []
    for n, tensors in enumerate((first, second), start=1):
        files.append(work_dir / f"model-{n:05d}-of-00002.safetensors")
        save_file(tensors, str(files[-1]), metadata={"format": "pt"})
        # Pages still being written back make mapped reads erratic for a while: measure a
        # cache as a node has it, clean and in memory.
        fd = os.open(files[-1], os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return files


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def touch(tensors: Iterable[torch.Tensor]) -> int:
    """Read every byte of every tensor once; a checksum both loaders must agree on."""
    # A max over the bits as integers of the same width: memory-bound and never skipped, where
    # a float sum of bf16 would be bound by conversion arithmetic instead.
    maxes = [t.view(_SAME_SIZE_INT[t.element_size()]).max().to(torch.int64)
             for t in tensors if t.numel()]
    return int(torch.stack(maxes).sum())


def _time(fn: Callable[[], int], device: str) -> tuple[float, int]:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    checksum = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, checksum


def _side_by_side(ours: Callable[[], int], baseline: Callable[[], int], device: str,
                  repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each run, alternating which goes first, after warm-up runs of each."""
    for _ in range(WARMUP):
        warm_ours, warm_base = ours(), baseline()
        if warm_ours != warm_base:
            raise AssertionError(f"checksums differ: ours {warm_ours}, baseline {warm_base}")
    ours_s: list[float] = []
    base_s: list[float] = []
    for r in range(repeats):
        order = ((ours, ours_s), (baseline, base_s)) if r % 2 == 0 else ((baseline, base_s), (ours, ours_s))
        for fn, out in order:
            seconds, _ = _time(fn, device)
            out.append(seconds)
    return ours_s, base_s


def _load_figure(files: list[Path], total: int, device: str, repeats: int) -> Figure:
    def ours() -> int:
        return touch(t for _, t in stream_tensors(files, device))

    def baseline() -> int:
        return touch(t for f in files for t in safetensors_load_file(str(f), device=device).values())

    ours_s, base_s = _side_by_side(ours, baseline, device, repeats)
    log(f"load+touch on {device}: ours median {median(ours_s) * 1e3:.1f} ms, "
        f"safetensors.torch.load_file median {median(base_s) * 1e3:.1f} ms")
    return Figure(BENCH, "load_vs_safetensors_load_file", total / median(ours_s), total / median(base_s),
                  "safetensors.torch.load_file", ">= 1", "bytes/s")


def _h2d_figure(files: list[Path], total: int, device: str, repeats: int) -> Figure:
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(total, dtype=torch.uint8, device=device)

    def ours() -> int:
        loaded = [t for _, t in stream_tensors(files, device)]
        return len(loaded)

    def pinned_copy() -> int:
        dev.copy_(host, non_blocking=True)
        return 0

    for _ in range(WARMUP):
        _time(ours, device), _time(pinned_copy, device)
    ours_s: list[float] = []
    base_s: list[float] = []
    for r in range(repeats):
        pair = ((ours, ours_s), (pinned_copy, base_s))
        for fn, out in pair if r % 2 == 0 else reversed(pair):
            out.append(_time(fn, device)[0])
    log(f"host->device on {device}: ours median {median(ours_s) * 1e3:.1f} ms, "
        f"pinned copy median {median(base_s) * 1e3:.1f} ms ({total / median(base_s) / 1e9:.1f} GB/s)")
    return Figure(BENCH, "h2d_vs_pinned_copy", total / median(ours_s), total / median(base_s),
                  "pinned host->device copy_", ">= 0.7", "bytes/s")


def run(work_dir: Path, *, full: bool = False, device: str = "cpu", work: Workload | None = None) -> list[Figure]:
    """Measure every figure of this bench on shards written into `work_dir`; quick unless `full`
    (or `work`'s sizes)."""
    work = work or (FULL if full else QUICK)
    device = resolve_device(device)
    files = make_shards(work_dir, work)
    total = sum(f.stat().st_size for f in files)
    log(f"{len(files)} shards, {total / 2**20:.0f} MiB, device {device}, {work.repeats} repetitions, "
        f"torch threads {torch.get_num_threads()}, {'full' if full else 'quick'} workload")
    figures = [_load_figure(files, total, device, work.repeats)]
    if device.startswith("cuda"):
        figures.append(_h2d_figure(files, total, device, work.repeats))
    return figures


def bench_load(work_dir: Path, *, quick: bool, device: str) -> list[dict[str, object]]:
    """The JSON-line dicts of this bench, shards written into `work_dir`."""
    return [json.loads(fig.json_line()) for fig in run(work_dir, full=not quick, device=device)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="a bigger checkpoint, more repetitions")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (falls back to cpu without CUDA)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meridian-bench-weights-") as tmp:
        for fig in run(Path(tmp), full=args.full, device=args.device):
            print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
