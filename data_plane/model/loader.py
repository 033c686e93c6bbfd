"""Load a Hugging Face Llama-family checkpoint (config.json + safetensors) into LlamaForCausalLM."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from data_plane.model.llama import LlamaConfig, LlamaForCausalLM
from data_plane.model.safetensors_stream import SafetensorsError, SafetensorsHeader, stream_tensors

INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or its tensors do not fit the config."""


def resolve_dtype(name: str, config_dtype: str | None = None) -> torch.dtype:
    """Map a dtype name ("auto" = the checkpoint's torch_dtype) to a torch dtype."""
    if name == "auto":
        name = config_dtype or "float32"
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unsupported dtype {name!r}") from None


def read_config(model_dir: Path) -> dict[str, object]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return raw


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those the shard index names, else every *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"shards named in {INDEX_FILE} are missing: {missing}")
    return files


def load_model(
    model_dir: Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    files: Iterable[Path] | None = None,
) -> LlamaForCausalLM:
    """Load config and weights from a checkpoint directory (or `files` as they arrive), ready for inference."""
    # `files` (default: every weight file of `model_dir`) may block between shards still
    # downloading; each shard is loaded while the next one is on its way.
    raw = read_config(model_dir)
    config = LlamaConfig.from_hf(raw)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(
        dtype, str(raw.get("torch_dtype")) if raw.get("torch_dtype") else None
    )
    target = torch.device(device)

    # Qwen2-style checkpoints carry q/k/v biases whether or not the config says so, and with
    # shards still arriving that is known only at the end: check names and shapes against a
    # model with biases, and build the real one once every tensor is in. Both are built on the
    # meta device, so nothing is allocated or randomly initialised for parameters that are
    # about to be replaced by the checkpoint's tensors.
    with_bias = config if config.attention_bias else dataclasses.replace(config, attention_bias=True)
    allowed = parameter_shapes(with_bias)
    seen: dict[str, str] = {}

    def check(header: SafetensorsHeader) -> None:
        for spec in header.tensors:
            name, file = spec.name, header.path.name
            if name in seen:
                raise CheckpointError(f"tensor {name!r} is in both {seen[name]} and {file}")
            seen[name] = file
            if name not in allowed:
                # Older checkpoints store the (recomputed) rotary frequencies.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise CheckpointError(f"unexpected tensor {name!r} in {file}")
            if spec.shape != tuple(allowed[name]):
                raise CheckpointError(
                    f"{name}: shape {spec.shape} != expected {tuple(allowed[name])} in {file}")

    state: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in stream_tensors(
            safetensors_files(model_dir) if files is None else files, target, torch_dtype,
            on_header=check,
        ):
            if name in allowed:
                state[name] = tensor
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from e

    if not config.attention_bias and any(n.endswith("self_attn.q_proj.bias") for n in state):
        config = with_bias
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name for name, _ in model.named_parameters()}
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise CheckpointError(f"unexpected tensors (the config has no attention bias): {unexpected[:8]}")
    tied = config.tie_word_embeddings and "lm_head.weight" not in state
    missing = sorted(expected - set(state) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors: {missing[:8]}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(target)
    model.eval()
    return model


def parameter_shapes(config: LlamaConfig) -> dict[str, torch.Size]:
    """Every parameter's name and shape in a model of `config` (nothing allocated)."""
    with torch.device("meta"):
        return {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
