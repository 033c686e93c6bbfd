"""Loading PEFT LoRA adapters: what is accepted, how it is scaled, and what is refused."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.lora import (
    LORA_MODULES,
    LoraConfigError,
    LoraError,
    LoraFilesError,
    LoraRankError,
    LoraShapeError,
    UnsupportedLoraModuleError,
    load_adapter,
)
from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.llama import LlamaConfig

Tensors = dict[str, torch.Tensor]
Config = dict[str, Any]
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def tiny_lora(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lora(tiny_checkpoint, tmp_path_factory.mktemp("lora") / "tiny-lora", seed=3)


def variant(
    src: Path, dst: Path, edit: Callable[[Config, Tensors], None] | None = None
) -> Path:
    """A copy of the adapter at src, with its config and tensors changed by edit."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    if edit is not None:
        edit(config, tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def keep_only(tensors: Tensors, modules: tuple[str, ...]) -> None:
    for name in list(tensors):
        if not any(f".{m}." in name for m in modules):
            del tensors[name]


def test_loads_every_projection_of_every_layer(tiny_lora: Path, base: LlamaConfig) -> None:
    adapter = load_adapter(tiny_lora, base, max_rank=64)
    raw = load_file(str(tiny_lora / "adapter_model.safetensors"))
    assert adapter.name == "tiny-lora"
    assert adapter.rank == 8
    assert adapter.modules == frozenset(LORA_MODULES)
    assert len(adapter.weights) == base.num_hidden_layers * len(LORA_MODULES)
    q = adapter.get(1, "q_proj")
    down = adapter.get(0, "down_proj")
    assert q is not None and down is not None
    assert q.scaling == 16 / 8  # lora_alpha / r
    assert torch.equal(q.a, raw[f"{PREFIX}.1.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(q.b, raw[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"])
    assert tuple(down.a.shape) == (8, base.intermediate_size)
    assert tuple(down.b.shape) == (base.hidden_size, 8)
    k = adapter.get(0, "k_proj")
    assert k is not None and tuple(k.b.shape) == (base.num_key_value_heads * base.head_dim, 8)


def test_weights_are_converted_to_the_serving_dtype(tiny_lora: Path, base: LlamaConfig) -> None:
    adapter = load_adapter(tiny_lora, base, max_rank=8, dtype=torch.bfloat16)
    assert {w.a.dtype for w in adapter.weights.values()} == {torch.bfloat16}
    assert {w.b.dtype for w in adapter.weights.values()} == {torch.bfloat16}


def test_accepts_tensor_names_without_the_peft_prefix(
    tiny_lora: Path, base: LlamaConfig, tmp_path: Path
) -> None:
    def strip(_: Config, tensors: Tensors) -> None:
        for name in list(tensors):
            tensors[name.removeprefix("base_model.model.")] = tensors.pop(name)

    plain = load_adapter(variant(tiny_lora, tmp_path / "plain", strip), base, max_rank=8)
    peft = load_adapter(tiny_lora, base, max_rank=8)
    assert plain.weights.keys() == peft.weights.keys()
    for key, w in peft.weights.items():
        assert torch.equal(plain.weights[key].a, w.a) and torch.equal(plain.weights[key].b, w.b)


def test_rslora_scales_by_the_square_root_of_the_rank(
    tiny_lora: Path, base: LlamaConfig, tmp_path: Path
) -> None:
    def rslora(config: Config, _: Tensors) -> None:
        config["use_rslora"] = True

    adapter = load_adapter(variant(tiny_lora, tmp_path / "rs", rslora), base, max_rank=8)
    assert {w.scaling for w in adapter.weights.values()} == {16 / math.sqrt(8)}


def test_rank_and_alpha_patterns_apply_per_module(
    tiny_lora: Path, base: LlamaConfig, tmp_path: Path
) -> None:
    def patterns(config: Config, tensors: Tensors) -> None:
        config["rank_pattern"] = {"q_proj": 4}
        config["alpha_pattern"] = {"layers.1.mlp.up_proj": 2}
        for name in list(tensors):
            if ".q_proj.lora_A" in name:
                tensors[name] = tensors[name][:4].contiguous()
            elif ".q_proj.lora_B" in name:
                tensors[name] = tensors[name][:, :4].contiguous()

    adapter = load_adapter(variant(tiny_lora, tmp_path / "pat", patterns), base, max_rank=8)
    q, up0, up1 = adapter.get(0, "q_proj"), adapter.get(0, "up_proj"), adapter.get(1, "up_proj")
    assert q is not None and up0 is not None and up1 is not None
    assert (q.rank, q.scaling) == (4, 16 / 4)
    assert (up0.rank, up0.scaling) == (8, 16 / 8)
    assert (up1.rank, up1.scaling) == (8, 2 / 8)


@pytest.mark.parametrize(
    "target_modules",
    [["q_proj", "v_proj"], ["self_attn.q_proj", "self_attn.v_proj"], r".*\.(q|v)_proj"],
)
def test_adapter_on_some_projections_touches_only_those(
    tiny_lora: Path, base: LlamaConfig, tmp_path: Path, target_modules: list[str] | str
) -> None:
    def qv(config: Config, tensors: Tensors) -> None:
        config["target_modules"] = target_modules
        keep_only(tensors, ("q_proj", "v_proj"))

    adapter = load_adapter(variant(tiny_lora, tmp_path / "qv", qv), base, max_rank=8)
    assert adapter.modules == {"q_proj", "v_proj"}
    assert adapter.get(0, "k_proj") is None
    assert adapter.get(1, "v_proj") is not None


def test_all_linear_shorthand_means_the_seven_projections(
    tiny_lora: Path, base: LlamaConfig, tmp_path: Path
) -> None:
    def all_linear(config: Config, _: Tensors) -> None:
        config["target_modules"] = "all-linear"

    adapter = load_adapter(variant(tiny_lora, tmp_path / "al", all_linear), base, max_rank=8)
    assert adapter.modules == frozenset(LORA_MODULES)


def _set(key: str, value: Any) -> Callable[[Config, Tensors], None]:
    def edit(config: Config, _: Tensors) -> None:
        config[key] = value

    return edit


def _lm_head_tensor(_: Config, tensors: Tensors) -> None:
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(1000, 8)


def _layer_beyond_the_model(_: Config, tensors: Tensors) -> None:
    tensors[f"{PREFIX}.2.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 64)
    tensors[f"{PREFIX}.2.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 8)


def _drop_b(_: Config, tensors: Tensors) -> None:
    del tensors[f"{PREFIX}.0.mlp.up_proj.lora_B.weight"]


def _another_models_shapes(_: Config, tensors: Tensors) -> None:
    # An adapter trained for a model with hidden size 128.
    tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 128)


def _mismatched_pair(_: Config, tensors: Tensors) -> None:
    tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)


def _rank_disagrees_with_config(config: Config, _: Tensors) -> None:
    config["r"] = 4


def _no_lora_tensors(_: Config, tensors: Tensors) -> None:
    tensors.clear()


def _only_unexpected(_: Config, tensors: Tensors) -> None:
    tensors[f"{PREFIX}.0.self_attn.rotary_emb.lora_A.weight"] = torch.zeros(8, 64)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (_set("bias", "all"), LoraConfigError, "bias"),
        (_set("fan_in_fan_out", True), LoraConfigError, "fan_in_fan_out"),
        (_set("use_dora", True), LoraConfigError, "DoRA"),
        (_set("peft_type", "IA3"), LoraConfigError, "IA3"),
        (_set("r", 0), LoraConfigError, "positive"),
        (_set("target_modules", None), LoraConfigError, "target_modules"),
        (_set("target_modules", "(unclosed"), LoraConfigError, "regex"),
        (_set("target_modules", ["q_proj", "lm_head"]), UnsupportedLoraModuleError, "lm_head"),
        (_set("target_modules", ["embed_tokens"]), UnsupportedLoraModuleError, "embed_tokens"),
        (_set("target_modules", r"model\.embed_tokens|.*_proj"), UnsupportedLoraModuleError,
         "embed_tokens"),
        (_set("target_modules", ["query_key_value"]), UnsupportedLoraModuleError, "match no module"),
        (_set("modules_to_save", ["lm_head"]), UnsupportedLoraModuleError, "modules_to_save"),
        (_lm_head_tensor, UnsupportedLoraModuleError, "lm_head"),
        (_only_unexpected, UnsupportedLoraModuleError, "rotary_emb"),
        (_layer_beyond_the_model, LoraShapeError, "layer 2"),
        (_drop_b, LoraShapeError, "lora_B weight is missing"),
        (_another_models_shapes, LoraShapeError, "128 -> 64"),
        (_mismatched_pair, LoraShapeError, "not a LoRA pair"),
        (_rank_disagrees_with_config, LoraShapeError, "rank 8"),
        (_no_lora_tensors, LoraFilesError, "no LoRA weights"),
    ],
)
def test_refuses_adapters_it_cannot_serve_correctly(
    tiny_lora: Path,
    base: LlamaConfig,
    tmp_path: Path,
    edit: Callable[[Config, Tensors], None],
    error: type[LoraError],
    match: str,
) -> None:
    bad = variant(tiny_lora, tmp_path / "bad", edit)
    with pytest.raises(error, match=match):
        load_adapter(bad, base, max_rank=64)


def test_refuses_a_rank_above_max_lora_rank(tiny_lora: Path, base: LlamaConfig) -> None:
    with pytest.raises(LoraRankError, match="max_lora_rank 4"):
        load_adapter(tiny_lora, base, max_rank=4)
    assert load_adapter(tiny_lora, base, max_rank=8).rank == 8


def test_refuses_a_pattern_rank_above_max_lora_rank(
    tiny_lora: Path, base: LlamaConfig, tmp_path: Path
) -> None:
    def bigger_q(config: Config, tensors: Tensors) -> None:
        config["r"], config["rank_pattern"] = 4, {"q_proj": 8}
        for name in list(tensors):
            if ".q_proj." not in name:
                tensors[name] = tensors[name][:4] if "lora_A" in name else tensors[name][:, :4]
                tensors[name] = tensors[name].contiguous()

    adapter_dir = variant(tiny_lora, tmp_path / "mixed", bigger_q)
    with pytest.raises(LoraRankError, match="q_proj: rank 8"):
        load_adapter(adapter_dir, base, max_rank=4)
    assert load_adapter(adapter_dir, base, max_rank=8).rank == 8


def test_missing_or_unreadable_files_are_files_errors(
    tiny_lora: Path, base: LlamaConfig, tmp_path: Path
) -> None:
    with pytest.raises(LoraFilesError, match="not found"):
        load_adapter(tmp_path / "nowhere", base, max_rank=8)

    no_config = variant(tiny_lora, tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoraFilesError, match="adapter_config.json not found"):
        load_adapter(no_config, base, max_rank=8)

    bin_only = variant(tiny_lora, tmp_path / "bin-only")
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    with pytest.raises(LoraFilesError, match="only safetensors"):
        load_adapter(bin_only, base, max_rank=8)

    corrupt = variant(tiny_lora, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoraFilesError, match="cannot read"):
        load_adapter(corrupt, base, max_rank=8)

    not_json = variant(tiny_lora, tmp_path / "not-json")
    (not_json / "adapter_config.json").write_text("{r: 8")
    with pytest.raises(LoraFilesError, match="cannot read"):
        load_adapter(not_json, base, max_rank=8)
