"""`python -m bench` (`make bench`): every benchmark in its quick form, JSON lines out."""

import tempfile
from pathlib import Path

from bench import (
    attacks,
    engine,
    engine_vllm,
    failover,
    flow_control,
    gpu_proof,
    kv_index,
    lease_writes,
    migration,
    pd,
    placement,
    probes,
    protocols,
    router,
    router_overhead,
    router_workers,
    routing,
    routing_table,
    routing_vllm,
    scale,
    stream_reads,
    stream_relay,
    weights,
)
from meridian.cpus import usable_cpus


def main() -> None:
    for fig in router_overhead.run(requests=100):
        print(fig.json_line(), flush=True)
    for fig in router.run():
        print(fig.json_line(), flush=True)
    for fig in router_workers.run(usable_cpus(), rounds=3, seconds=2.0):
        print(fig.json_line(), flush=True)
    for fig in stream_relay.run(seconds=2.0, rounds=2):
        print(fig.json_line(), flush=True)
    for fig in stream_reads.run(chunks=20_000, rounds=3):
        print(fig.json_line(), flush=True)
    for fig in protocols.run(protocols.Settings(seconds=2.0, rounds=2, requests=20)):
        print(fig.json_line(), flush=True)
    for fig in routing.run():
        print(fig.json_line(), flush=True)
    # The routing-table stream at 1,000 nodes (`python -m bench.routing_table` adds 10,000).
    for fig in routing_table.run(sizes=(1000,)):
        print(fig.json_line(), flush=True)
    # Probes and install listeners at 1,000 nodes (`python -m bench.probes` adds 10,000).
    for fig in probes.run(sizes=(1000,), probe_seconds=2.0):
        print(fig.json_line(), flush=True)
    # The router's KV-prefix index against its bitmask predecessor at 1,000 nodes x 512 blocks
    # (`python -m bench.kv_index --nodes 1000 3000` for more).
    for fig in kv_index.run(sizes=(1000,), rounds=2):
        print(fig.json_line(), flush=True)
    # Postgres's CPU per heartbeat renewal, HOT against the indexed schema before it, 2,000
    # nodes (`python -m bench.lease_writes` for 10,000).
    for fig in lease_writes.run(nodes=2000, seconds=8.0, rounds=1):
        print(fig.json_line(), flush=True)
    for fig in failover.run():
        print(fig.json_line(), flush=True)
    for fig in migration.run():
        print(fig.json_line(), flush=True)
    for fig in pd.run(seconds=10.0):
        print(fig.json_line(), flush=True)
    # Flow control under saturation (issue 37), quick form: 10 s windows (`python -m
    # bench.flow_control` for 20 s).
    for fig in flow_control.run(flow_control.Load(seconds=10.0, warmup_s=5.0)):
        print(fig.json_line(), flush=True)
    for fig in engine.run():
        print(fig.json_line(), flush=True)
    # Against vLLM's CPU build (`make bench` installs it with `make vllm`).
    for fig in engine_vllm.run():
        print(fig.json_line(), flush=True)
    for fig in routing_vllm.run():
        print(fig.json_line(), flush=True)
    for fig in weights.run():
        print(fig.json_line(), flush=True)
    for fig in placement.run():
        print(fig.json_line(), flush=True)
    # Fleet scale (issue 34), quick form: 300 simulated nodes against the real control plane on
    # Postgres, about a minute (`python -m bench.scale --full` for the 100 -> 10,000 curve).
    for fig in scale.run():
        print(fig.json_line(), flush=True)
    # The listener attack suite (issue 33), short form: ~80 s.
    for result in attacks.run():
        for fig in attacks.figures(result):
            print(fig.json_line(), flush=True)
    # The GPU proof's dry run (issue 38): every step of `python -m bench.gpu_proof` on the CPU
    # at its smallest, about 9 minutes, so that the script a GPU machine will run has run; its
    # figures are plumbing, not measurements, and stay in its own folder, not printed.
    with tempfile.TemporaryDirectory(prefix="meridian-gpu-proof-") as tmp:
        if gpu_proof.dry_run(Path(tmp) / "proof") != 0:
            raise SystemExit("bench.gpu_proof --dry-run: a step failed (its progress above says which)")


if __name__ == "__main__":
    main()
