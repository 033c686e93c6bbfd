"""Routing quality on real vLLM: precise KV-aware routing (the router's exact index fed by
vLLM's KV events, re-keyed on the node) against approximate (the same affinity policy on
routing history only) and round robin, on a multi-turn chat workload.

    python -m bench.routing_vllm [--full] [--repeats N]

One local fabric: a control plane and four nodes running vLLM's CPU build (`make vllm`)
in one region, each with a KV cache that holds about its share of the live conversations
(`--num-gpu-blocks-override`, blocks of 32 tokens, the smallest vLLM's CPU attention
takes) but not all of them, and two routers per policy, all reading the same routing
table: as behind any load balancer, each turn goes to either router at random. Precise
routers both subscribe to every node's KV events; approximate ones know only their own
routing history (bench.routing measures history shared through Redis). The workload is
bench.routing's: users share a few system prompts and hold conversations that grow a
turn at a time, streamed so that time to first token is measured at the client; every
policy gets its own copy with different words. The model is big enough (hidden 768, 8
layers) that a conversation's prefill, not the machine's scheduling, dominates time to
first token. Hit rate is what vLLM itself reports (`vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries`, summed over the nodes, before and after a run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.common import Figure, percentile
from bench.routing import MODEL, REGION, RunResult, Workload, chat_workload, log, measure
from data_plane.engine.vllm.command import default_vllm_python
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from localfabric import FabricSpec, local_fabric

BENCH = "routing_vllm"
# head_dim 64, which vLLM's CPU attention needs.
ARCH = TinyArch(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=2048, max_position_embeddings=4096)
BLOCK = 32
ROUTERS_PER_POLICY = 2
# A node's KV cache: the fleet holds the live conversations (12 of ~1100 tokens at the
# last turn: ~3300 a node when each lives on one), one node does not.
# Six users at a time keep four CPU nodes on two cores out of saturation, so that time to
# first token measures prefill (what a cache hit saves) more than queueing behind others.
QUICK = replace(Workload(), users=6, cache_tokens_per_node=4096)
FULL = replace(Workload(users=24, conversations=48), cache_tokens_per_node=8192)
POLICIES = {
    "precise": {"MERIDIAN_ROUTER_ROUTING_POLICY": "affinity"},
    "approximate": {"MERIDIAN_ROUTER_ROUTING_POLICY": "affinity", "MERIDIAN_ROUTER_KV_EVENTS_ENABLED": "false"},
    "round-robin": {"MERIDIAN_ROUTER_ROUTING_POLICY": "round-robin"},
}


def p90_ms(r: RunResult) -> float:
    return percentile(r.ttfts, 0.9) * 1000


def _engine_spec(device: str, nodes: int) -> dict[str, object]:
    """What the vLLM nodes run with beyond the model: the CPU build's KV space and threads, or
    on a GPU, bfloat16 and a share of the GPU's memory per node (every node on one GPU)."""
    if device.startswith("cuda"):
        return {"dtype": "bfloat16", "gpu_memory_utilization": round(0.8 / nodes, 3)}
    return {"dtype": "float32", "cpu_kvcache_space_gib": 1, "cpu_threads_bind": "nobind"}


def run(full: bool = False, repeats: int = 1, workload: Workload | None = None, device: str = "cpu") -> list[Figure]:
    """`workload`: other sizes than quick's or full's; `device`: cuda where vLLM's GPU build is
    the one in .venv-vllm."""
    w = workload or (FULL if full else QUICK)
    if ".venv-vllm" not in default_vllm_python():
        raise SystemExit("vLLM is not installed in .venv-vllm: run `make vllm` first (its CPU build)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / MODEL, seed=0, arch=w.arch or ARCH)
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps({
            "name": MODEL, "model": MODEL, "max_model_len": 2048, "max_num_seqs": 16, "block_size": BLOCK,
            **_engine_spec(device, w.nodes),
            "extra_args": ["--num-gpu-blocks-override", str(w.cache_tokens_per_node // BLOCK)],
        }))
        spec = FabricSpec(
            work_dir=Path(tmp) / "fabric", regions=(REGION,), model_name=MODEL, model_dir=model_dir,
            nodes_per_region=w.nodes, default_client_location=REGION, engine="vllm", start_timeout_s=900.0,
            node_env={"MERIDIAN_NODE_DEPLOYMENT_SPEC_FILE": str(spec_file)},
        )
        with local_fabric(spec, on_step=log) as fabric:
            routers = {name: [fabric.start_router(env).url for _ in range(ROUTERS_PER_POLICY)]
                       for name, env in POLICIES.items()}

            async def main() -> dict[str, list[RunResult]]:
                out: dict[str, list[RunResult]] = {}
                salt = 100
                for _ in range(repeats):
                    for name in POLICIES:
                        salt += 1
                        result = await measure(fabric, routers[name], name, w, salt, chat_workload)
                        log(f"{name}: P90 TTFT {p90_ms(result):.1f} ms")
                        out.setdefault(name, []).append(result)
                return out

            runs = asyncio.run(main())

    def med(name: str, fn: object) -> float:
        return statistics.median(fn(r) for r in runs[name])  # type: ignore[operator]

    def hit_rate(r: RunResult) -> float:
        return r.hit_rate

    return [
        Figure(BENCH, "hit_rate_precise_vs_round_robin", med("precise", hit_rate), med("round-robin", hit_rate),
               "round robin", "ratio >= 2 (prefix-cache hit rate vLLM reports)", "ratio"),
        Figure(BENCH, "ttft_p90_precise_vs_round_robin", med("precise", p90_ms), med("round-robin", p90_ms),
               "round robin", "ratio <= 0.5", "ms"),
        Figure(BENCH, "ttft_p90_precise_vs_approximate", med("precise", p90_ms), med("approximate", p90_ms),
               "approximate (routing history only)", "ratio <= 0.8", "ms"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="more users and conversations")
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy; figures are medians")
    args = ap.parse_args()
    for fig in run(full=args.full, repeats=args.repeats):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
