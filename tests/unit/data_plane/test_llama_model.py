"""The torch Llama: loads Hugging Face checkpoints and computes what the architecture says."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.model.llama import LlamaConfig, UnsupportedModelError, rope_inv_freq
from data_plane.model.loader import CheckpointError, load_model


def reference_logits(ckpt: Path, ids: list[int]) -> torch.Tensor:
    """The Llama forward pass written out plainly, in float64, from the raw tensors."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, base = cfg["rms_norm_eps"], cfg["rope_theta"]
    n = len(ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [T, heads, d]
        out = x.clone()
        for pos in range(n):
            for i in range(d // 2):
                angle = pos * base ** (-2 * i / d)
                a, b = x[pos, :, i], x[pos, :, i + d // 2]
                out[pos, :, i] = a * math.cos(angle) - b * math.sin(angle)
                out[pos, :, i + d // 2] = b * math.cos(angle) + a * math.sin(angle)
        return out

    x = w["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
        attn = torch.zeros(n, heads, d, dtype=torch.float64)
        for head in range(heads):
            kvh = head // (heads // kv_heads)
            for i in range(n):
                scores = torch.stack([q[i, head] @ k[j, kvh] / math.sqrt(d) for j in range(i + 1)])
                probs = torch.softmax(scores, dim=0)
                attn[i, head] = sum(probs[j] * v[j, kvh] for j in range(i + 1))
        x = x + attn.reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_loaded_parameters_match_config(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, dtype="float32", device="cpu")
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.head_dim) == (1000, 64, 16)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (2 * 16, 64)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 176)
    assert shapes["lm_head.weight"] == (1000, 64)
    assert all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())
    raw = load_file(str(tiny_checkpoint / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, raw[name]), name


def test_forward_matches_reference(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)
    ids = [0, 17, 300, 42, 999, 5, 64]
    logits = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(16), last_only=False)
    expected = reference_logits(tiny_checkpoint, ids)
    torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-4)


def test_incremental_decode_with_cache_equals_full_recompute(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)
    ids = torch.tensor([0, 250, 12, 77, 500, 31, 8, 640, 2])
    full = model(ids, torch.arange(len(ids)), model.new_cache(len(ids)), last_only=False)
    cache = model.new_cache(len(ids))
    model(ids[:4], torch.arange(4), cache)
    steps = [model(ids[i:i + 1], torch.tensor([i]), cache) for i in range(4, len(ids))]
    assert cache.length == len(ids)
    torch.testing.assert_close(torch.stack(steps), full[4:], atol=1e-5, rtol=1e-5)


def test_bfloat16_load(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    logits = model(torch.tensor([0, 5, 9]), torch.arange(3), model.new_cache(3))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def _rewrite(src: Path, dst: Path, config_update: dict[str, object]) -> dict[str, torch.Tensor]:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config_update)
    (dst / "config.json").write_text(json.dumps(cfg))
    return load_file(str(src / "model.safetensors"))


def test_sharded_checkpoint_with_tied_embeddings(tiny_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "sharded"
    tensors = _rewrite(tiny_checkpoint, dst, {"tie_word_embeddings": True})
    del tensors["lm_head.weight"]
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(dst / file))
        weight_map.update(dict.fromkeys(members, file))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))

    model = load_model(dst)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_qwen2_style_attention_biases_load(tiny_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "qwen"
    tensors = _rewrite(tiny_checkpoint, dst, {"model_type": "qwen2"})
    for i in range(2):
        for proj, dim in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
            tensors[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.full((dim,), 0.5)
    save_file(tensors, str(dst / "model.safetensors"))
    model = load_model(dst)
    bias = model.model.layers[1].self_attn.k_proj.bias
    assert bias is not None and torch.equal(bias, torch.full((32,), 0.5))


def test_checkpoint_errors_are_clear(tiny_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "bad"
    tensors = _rewrite(tiny_checkpoint, dst, {})
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(dst)
    del tensors["model.norm.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks"):
        load_model(dst)
    with pytest.raises(CheckpointError):
        load_model(tmp_path / "missing")


def test_unsupported_architecture_is_refused() -> None:
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(UnsupportedModelError):
        LlamaConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError):
        LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_llama3_rope_scaling_stretches_only_long_wavelengths() -> None:
    base = {"vocab_size": 10, "hidden_size": 1024, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 8, "rope_theta": 500000.0}
    plain = rope_inv_freq(LlamaConfig.from_hf(base))
    scaled = rope_inv_freq(LlamaConfig.from_hf({**base, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}))
    wavelen = 2 * math.pi / plain
    short = wavelen < 8192 / 4
    long = wavelen > 8192 / 1
    assert short.any() and long.any()
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()
