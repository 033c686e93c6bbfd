"""Engine: Meridian's torch engine against vLLM's CPU build, on the same checkpoint and
the same requests, side by side in one run.

    python -m bench.engine_vllm [--full] [--repeats N]

Figure (ours / baseline, reported as it comes out, no goal):

- throughput_vs_vllm_cpu: generated tokens/s of bench.engine's 32 concurrent mixed-length
  requests (greedy, EOS ignored) on the torch engine / on vLLM's CPU build (`make vllm`),
  both reached through the Engine protocol (vLLM through the node's adapter, which adds a
  loopback HTTP hop per request), both float32, prefix caching and chunked prefill on.

The checkpoint is bench.engine's model with head_dim 64, which vLLM's CPU attention needs.
vLLM runs with its threads unbound (`cpu_threads_bind: nobind`), as the torch engine runs,
so that both may use every core. The two engines take turns on each request set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import torch

from bench.common import Figure
from bench.engine import FULL, QUICK, Target, _Rate, engine_throughput, log, node_settings, running_engine
from bench.engine import throughput_requests as requests_for
from data_plane.engine.vllm.command import default_vllm_python
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint

BENCH = "engine"
# bench.engine's model with head_dim 64, which vLLM's CPU attention needs.
ARCH = TinyArch(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=688, max_position_embeddings=4096)


async def _measure(target: Target, repeats: int, full: bool, seed: int, spec_file: Path) -> Figure:
    work = FULL if full else QUICK
    rates = {"torch": _Rate(), "vllm": _Rate()}
    same = total = 0
    vllm_settings = node_settings(target, engine="vllm", vllm_gpu_count=0, vllm_executable="auto",
                                  deployment_spec_file=spec_file, vllm_startup_timeout_s=600.0)
    async with running_engine(node_settings(target)) as ours, running_engine(vllm_settings) as vllm:
        for k in range(repeats):
            reqs = requests_for(work, target.vocab_size, seed + k)
            n, s, ours_traces = await engine_throughput(ours, reqs)
            rates["torch"].add(n, s)
            n, s, vllm_traces = await engine_throughput(vllm, reqs)
            rates["vllm"].add(n, s)
            same += sum(a.tokens == b.tokens for a, b in zip(ours_traces, vllm_traces, strict=True))
            total += len(reqs)
    log(f"torch engine: {rates['torch']}")
    log(f"vLLM CPU build: {rates['vllm']}")
    log(f"greedy outputs identical for {same}/{total} requests")
    return Figure(BENCH, "throughput_vs_vllm_cpu", rates["torch"].per_s, rates["vllm"].per_s,
                  "vLLM 0.32 CPU build, same checkpoint and requests", "reported as it comes out", "tokens/s")


def run(full: bool = False, repeats: int = 1, seed: int = 0) -> list[Figure]:
    if ".venv-vllm" not in default_vllm_python():
        raise SystemExit("vLLM's CPU build is not installed: run `make vllm` first")
    with tempfile.TemporaryDirectory(prefix="meridian-bench-") as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "bench-llama", seed=seed, arch=ARCH)
        config = json.loads((ckpt / "config.json").read_text())
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps({
            "name": "bench-llama", "model": "bench-llama", "dtype": "float32", "max_model_len": 4096,
            "max_num_seqs": 32, "max_num_batched_tokens": 512, "cpu_kvcache_space_gib": 1,
            "cpu_threads_bind": "nobind",
        }))
        target = Target(ckpt, "torch", "cpu", "float32", int(config["vocab_size"]))
        log(f"model hidden {ARCH.hidden_size}, {ARCH.num_hidden_layers} layers, head_dim {ARCH.head_dim}; "
            f"torch threads {torch.get_num_threads()}")
        return [asyncio.run(_measure(target, repeats, full, seed, spec_file))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="longer prompts and outputs")
    ap.add_argument("--repeats", type=int, default=3, help="request sets, each run on both engines")
    args = ap.parse_args()
    for fig in run(full=args.full, repeats=args.repeats):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
