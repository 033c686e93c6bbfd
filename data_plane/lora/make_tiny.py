"""Generate a tiny, deterministic PEFT LoRA adapter for a checkpoint from make_tiny_checkpoint.

The adapter has the file set, tensor names and config keys PEFT's save_pretrained writes,
and a non-zero B (unlike a freshly initialised adapter), so it behaves like a trained one:
greedy completions with and without it differ. Same base config and seed, same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from data_plane.lora.adapter import CONFIG_FILE, LORA_MODULES, WEIGHTS_FILE, module_key, module_shapes
from data_plane.model.llama import LlamaConfig
from data_plane.model.loader import read_config
from data_plane.model.make_tiny import atomic_dir, write_json

# Standard deviation of B's entries. PEFT starts B at zero; this is large enough that each
# projection's delta is comparable to the tiny base model's own outputs (weights ~ N(0, 0.02)),
# which visibly changes what the model generates.
B_STD = 0.05


def tiny_lora_config(base_name: str, rank: int, targets: Sequence[str]) -> dict[str, Any]:
    """An adapter_config.json in the shape PEFT writes for a causal-LM LoRA."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_name,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def random_lora_weights(
    config: LlamaConfig, seed: int, rank: int, targets: Sequence[str]
) -> dict[str, torch.Tensor]:
    """lora_A / lora_B tensors under PEFT's saved names for every targeted projection."""
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        # Fixed module order, not the caller's, so the bytes depend only on the target set.
        for module in (m for m in LORA_MODULES if m in targets):
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.{module_key(layer, module)}"
            # A uniform with variance 1/in_features, so x @ A.T is unit-scale for unit-scale x.
            bound = 1.0 / math.sqrt(in_features)
            a = (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound * math.sqrt(3)
            b = torch.randn(out_features, rank, generator=gen) * B_STD
            tensors[prefix + ".lora_A.weight"] = a.contiguous()
            tensors[prefix + ".lora_B.weight"] = b.contiguous()
    return tensors


def make_tiny_lora(
    base_dir: Path,
    out_dir: Path,
    seed: int = 0,
    *,
    rank: int = 8,
    targets: Sequence[str] = LORA_MODULES,
    overwrite: bool = False,
) -> Path:
    """Write a tiny LoRA adapter for the checkpoint in base_dir to out_dir atomically; return out_dir.

    Raises FileExistsError if out_dir exists and is not empty, unless overwrite is set;
    ValueError for an unknown target or a rank below 1; CheckpointError if base_dir has no config.
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {list(LORA_MODULES)}, got {list(targets)}")
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    config = LlamaConfig.from_hf(read_config(base_dir))
    # Same scheme as make_tiny_checkpoint, so a LoRA directory scan never finds a
    # half-written adapter.
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        # The base's directory name, not its path: the bytes must not depend on where it lives.
        write_json(tmp / CONFIG_FILE, tiny_lora_config(base_dir.resolve().name, rank, targets))
        save_file(random_lora_weights(config, seed, rank, targets), str(tmp / WEIGHTS_FILE),
                  metadata={"format": "pt"})
    return out_dir
