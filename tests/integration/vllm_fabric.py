"""A node running real vLLM (its CPU build, from `make vllm`) behind a real router.

vLLM starts in about 50 s on two cores, so one node serves a whole test module: the
module's tests share its event loop (`loop_scope="module"`). The checkpoint is the tiny
model shaped for vLLM's CPU attention (head_dim 64), with one LoRA adapter; the node runs
vLLM with the pythonic tool parser (named and "required" tool_choice) and the responses
store (previous_response_id), as a deployment would set them in its spec.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from tenant_fabric import MODEL, Tenant, TenantFabric, tenant_fabric

from data_plane.engine.vllm.command import default_vllm_python
from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.make_tiny import VLLM_CPU_ARCH, make_tiny_checkpoint

ADAPTER = "sql"
ALICE = Tenant("alice", "sk-alice-0123456789abcdef")
BOB = Tenant("bob", "sk-bob-0123456789abcdef00")


def vllm_installed() -> bool:
    """Whether `make vllm` has made .venv-vllm (CI's `make test` always does)."""
    return Path(default_vllm_python()).parent.parent.name == ".venv-vllm"


def make_vllm_checkpoint(root: Path) -> tuple[Path, Path]:
    """The tiny model vLLM's CPU build accepts, and a LoRA adapter for it."""
    checkpoint = make_tiny_checkpoint(root / MODEL, seed=0, arch=VLLM_CPU_ARCH)
    adapter = make_tiny_lora(checkpoint, root / "loras" / ADAPTER, seed=1)
    return checkpoint, adapter


def write_spec(path: Path, **overrides: object) -> Path:
    spec: dict[str, object] = {
        "name": MODEL, "model": MODEL, "max_model_len": 1024, "max_num_seqs": 8,
        "max_num_batched_tokens": 2048, "cpu_kvcache_space_gib": 1,
        "loras": [{"name": ADAPTER}], "max_lora_rank": 8,
        # A random-weight model would pad JSON with whitespace up to max_tokens.
        "extra_args": ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                       "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
        "env": {"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    }
    spec.update(overrides)
    path.write_text(json.dumps(spec))
    return path


@contextlib.asynccontextmanager
async def vllm_fabric(root: Path, **node: object) -> AsyncIterator[TenantFabric]:
    checkpoint, adapter = make_vllm_checkpoint(root)
    settings: dict[str, object] = {
        "engine": "vllm", "vllm_gpu_count": 0, "vllm_executable": "auto",
        "deployment_spec_file": write_spec(root / "spec.json"),
        "lora_modules": {ADAPTER: adapter}, "vllm_startup_timeout_s": 300.0,
        "vllm_probe_interval_s": 0.5, "drain_timeout_s": 30.0, "vllm_max_restarts": 1,
        "request_journal_path": root / "node-journal.jsonl",
    }
    settings.update(node)
    async with tenant_fabric(checkpoint, [ALICE, BOB], node=settings,
                             router={"read_timeout_s": 120.0, "request_timeout_s": 180.0,
                                     "max_request_bytes": 1_000_000,
                                     "tokenizer_dirs": {MODEL: checkpoint}}) as fabric:
        yield fabric
