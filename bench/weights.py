"""Cold-start benchmarks (issue 4): parallel ranged fetch against an origin that limits
each connection (nginx `limit_rate`, as S3 does), warm node-cache start against a cold
start from the origin, and the streaming loader against safetensors' load_file.

    python -m bench.weights [--full] [--device cuda]

Every figure is ours against a baseline measured in the same run; medians of
alternating repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from bench import weights_load
from bench.common import Figure, median
from bench.nginx import NginxServer, nginx_available
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from data_plane.server.app import create_app
from data_plane.weights.cache import NodeCache
from data_plane.weights.pull import WeightPuller
from data_plane.weights.push import push_model
from meridian.settings.node import NodeSettings, WeightSettings

MiB = 1024 * 1024


def _blob_files(root: Path, total_bytes: int, files: int) -> None:
    """Incompressible files that add up to total_bytes (the fetch benchmarks' payload)."""
    root.mkdir(parents=True, exist_ok=True)
    per = total_bytes // files
    block = bytes(range(256)) * (MiB // 256)
    import hashlib

    for i in range(files):
        with open(root / f"shard-{i:02d}.bin", "wb") as f:
            written = 0
            seed = hashlib.sha256(str(i).encode()).digest()
            while written < per:
                # Vary each MiB so nothing dedups or compresses along the way.
                f.write(seed + block[len(seed):])
                seed = hashlib.sha256(seed).digest()
                written += MiB


async def _single_stream(url: str, seconds: float) -> float:
    """Bytes/s of one plain GET (no ranges), read for at most `seconds`."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        got = 0
        began = time.perf_counter()
        async with client.stream("GET", url) as resp:
            resp.raise_for_status()
            async for chunk in resp.aiter_raw(1 << 20):
                got += len(chunk)
                if time.perf_counter() - began >= seconds:
                    break
        return got / (time.perf_counter() - began)


async def _pull_rate(uri: str, settings: WeightSettings, cache_dir: Path) -> float:
    """Bytes/s of a cold `pull` of the model at uri into an empty cache."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    s = settings.model_copy(update={"cache_dir": cache_dir})
    puller = WeightPuller(s, NodeCache(cache_dir))
    try:
        began = time.perf_counter()
        report = await puller.pull(uri)
        return report.fetched_bytes / (time.perf_counter() - began)
    finally:
        await puller.aclose()


def fetch_figures(work: Path, *, full: bool) -> list[Figure]:
    """parallel_fetch_vs_limit and parallel_fetch_vs_single_stream."""
    concurrency = 16
    # nginx grants each response one second of limit_rate up front ((t + 1) x rate by t
    # seconds); ranges of 8 s at the limit keep that burst to an eighth.
    limit = 1 * MiB  # bytes/s per connection
    chunk = 8 * MiB
    total = (512 if full else 128) * MiB
    model = work / "fetch-model"
    _blob_files(model, total, files=4)
    settings = WeightSettings(
        manifest_chunk_bytes=chunk, range_bytes=chunk, concurrency=concurrency, max_attempts=3,
    )
    origin_root = work / "origin"
    shutil.rmtree(origin_root, ignore_errors=True)
    (origin_root / "m").mkdir(parents=True)
    asyncio.run(push_model(model, f"file://{origin_root / 'm'}", settings))
    reps = 3 if full else 2
    with NginxServer(origin_root, work / "nginx-open") as open_origin, \
            NginxServer(origin_root, work / "nginx-limited", limit_rate=limit) as limited:
        ours, unthrottled, single = [], [], []
        for _ in range(reps):
            ours.append(asyncio.run(_pull_rate(f"{limited.url}/m", settings, work / "cache")))
            unthrottled.append(asyncio.run(_pull_rate(f"{open_origin.url}/m", settings, work / "cache")))
            single.append(asyncio.run(_single_stream(f"{limited.url}/m/shard-00.bin", 8.0 if full else 4.0)))
    shutil.rmtree(work / "cache", ignore_errors=True)
    ceiling = min(concurrency * limit, median(unthrottled))
    return [
        Figure("weights", "parallel_fetch_vs_limit", median(ours), ceiling,
               f"min({concurrency} x {limit // MiB} MiB/s limit_rate, unthrottled loopback)", ">= 0.8", "bytes/s"),
        Figure("weights", "parallel_fetch_vs_single_stream", median(ours), median(single),
               "one GET of the same files through the same limit", ">= 6", "bytes/s"),
    ]


async def _time_to_ready(settings: NodeSettings) -> float:
    began = time.perf_counter()
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await app.state.runtime.wait_ready()
        return time.perf_counter() - began


def start_figures(work: Path, *, full: bool) -> list[Figure]:
    """warm_start_vs_cold: node start to ready from its cache vs from the origin."""
    arch = TinyArch(hidden_size=1024, num_hidden_layers=12 if full else 4, num_attention_heads=16,
                    num_key_value_heads=8, intermediate_size=2816)
    ckpt = make_tiny_checkpoint(work / "start-model", arch=arch, overwrite=True)
    origin_root = work / "start-origin"
    shutil.rmtree(origin_root, ignore_errors=True)
    (origin_root / "bench-llama").mkdir(parents=True)
    weights = WeightSettings(manifest_chunk_bytes=16 * MiB, range_bytes=16 * MiB, concurrency=16)
    asyncio.run(push_model(ckpt, f"file://{origin_root / 'bench-llama'}", weights))
    reps = 3 if full else 2
    cold, warm = [], []
    with NginxServer(origin_root, work / "nginx-start") as origin:
        for i in range(reps):
            cache = work / f"start-cache-{i}"
            shutil.rmtree(cache, ignore_errors=True)
            settings = NodeSettings(
                model_uri=f"{origin.url}/bench-llama", control_plane_url=None, region="",
                kv_cache_memory_bytes=16 * MiB, weights=weights.model_copy(update={"cache_dir": cache}),
            )
            cold.append(asyncio.run(_time_to_ready(settings)))
            warm.append(asyncio.run(_time_to_ready(settings)))
            shutil.rmtree(cache, ignore_errors=True)
    return [Figure("weights", "warm_start_vs_cold", median(warm), median(cold),
                   "cold start: same node, empty cache, model from an nginx origin on loopback",
                   "<= 0.2", "s")]


def run(*, full: bool = False, device: str = "cpu") -> list[Figure]:
    """Every figure of the weights benchmark."""
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="meridian-bench-weights-") as tmp:
        work = Path(tmp)
        if nginx_available():
            figures += fetch_figures(work, full=full)
            figures += start_figures(work, full=full)
        else:
            print("nginx not found (apt-get install nginx-light): fetch and start figures skipped")
        (work / "load").mkdir()
        figures += weights_load.run(work / "load", full=full, device=device)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="bigger payloads, more repetitions")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (loader figures)")
    args = parser.parse_args()
    for fig in run(full=args.full, device=args.device):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
