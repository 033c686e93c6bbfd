"""The tiny checkpoint: Hugging Face layout, reproducible bytes, atomic writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from data_plane.model.make_tiny import SPECIAL_TOKENS, TinyArch, make_tiny_checkpoint

FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = make_tiny_checkpoint(tmp_path / "a", seed=7)
    b = make_tiny_checkpoint(tmp_path / "b", seed=7)
    assert FILES <= set(digests(a))
    assert digests(a) == digests(b)


def test_different_seed_gives_different_weights(tmp_path: Path, tiny_checkpoint: Path) -> None:
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    assert digests(other)["model.safetensors"] != digests(tiny_checkpoint)["model.safetensors"]
    assert digests(other)["config.json"] == digests(tiny_checkpoint)["config.json"]


def test_config_is_a_hugging_face_llama_config(tiny_checkpoint: Path) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    tok = json.loads((tiny_checkpoint / "tokenizer.json").read_text())
    vocab_size = len(tok["model"]["vocab"])
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"]) == (64, 176)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["num_hidden_layers"] == 2
    assert config["vocab_size"] == vocab_size
    assert 900 <= vocab_size <= 1100
    assert config["tie_word_embeddings"] is False
    vocab = tok["model"]["vocab"]
    assert config["bos_token_id"] == vocab["<|begin_of_text|>"]
    assert vocab["<|eot_id|>"] in config["eos_token_id"]


def test_weights_have_hugging_face_names_and_shapes(tiny_checkpoint: Path) -> None:
    with safe_open(str(tiny_checkpoint / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    vocab = shapes["model.embed_tokens.weight"][0]
    assert shapes["model.embed_tokens.weight"] == (vocab, 64)
    assert shapes["lm_head.weight"] == (vocab, 64)
    assert shapes["model.norm.weight"] == (64,)
    for i in range(2):
        p = f"model.layers.{i}."
        assert shapes[p + "self_attn.q_proj.weight"] == (64, 64)
        assert shapes[p + "self_attn.k_proj.weight"] == (32, 64)
        assert shapes[p + "self_attn.v_proj.weight"] == (32, 64)
        assert shapes[p + "self_attn.o_proj.weight"] == (64, 64)
        assert shapes[p + "mlp.gate_proj.weight"] == (176, 64)
        assert shapes[p + "mlp.up_proj.weight"] == (176, 64)
        assert shapes[p + "mlp.down_proj.weight"] == (64, 176)
        assert shapes[p + "input_layernorm.weight"] == (64,)
        assert shapes[p + "post_attention_layernorm.weight"] == (64,)
    assert len(shapes) == 3 + 2 * 9


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def test_architecture_sets_sizes_in_config_and_weights(tmp_path: Path) -> None:
    arch = TinyArch(hidden_size=128, num_hidden_layers=3, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=344, max_position_embeddings=4096)
    ckpt = make_tiny_checkpoint(tmp_path / "bigger", seed=0, arch=arch)
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (128, 344, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    assert (config["num_hidden_layers"], config["max_position_embeddings"]) == (3, 4096)
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    shapes = tensor_shapes(ckpt)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (32, 128)
    assert shapes["model.layers.2.mlp.down_proj.weight"] == (128, 344)
    assert len(shapes) == 3 + 3 * 9


def test_qwen2_architecture_has_attention_biases_and_tied_embeddings(tmp_path: Path) -> None:
    arch = TinyArch(model_type="qwen2", tie_word_embeddings=True)
    ckpt = make_tiny_checkpoint(tmp_path / "qwen2", seed=0, arch=arch)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    # Like Qwen2's own releases: the biases are implied, not declared.
    assert "attention_bias" not in config
    assert config["tie_word_embeddings"] is True
    shapes = tensor_shapes(ckpt)
    assert "lm_head.weight" not in shapes
    assert shapes["model.layers.1.self_attn.q_proj.bias"] == (64,)
    assert shapes["model.layers.1.self_attn.k_proj.bias"] == (32,)
    assert shapes["model.layers.1.self_attn.v_proj.bias"] == (32,)
    assert "model.layers.1.self_attn.o_proj.bias" not in shapes


def test_rope_scaling_is_written_to_the_config(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ckpt = make_tiny_checkpoint(tmp_path / "llama31", seed=0, arch=TinyArch(rope_scaling=scaling))
    assert json.loads((ckpt / "config.json").read_text())["rope_scaling"] == scaling


@pytest.mark.parametrize("bad", [
    {"hidden_size": 60, "num_attention_heads": 8},
    {"num_attention_heads": 4, "num_key_value_heads": 3},
    {"hidden_size": 60, "num_attention_heads": 4, "num_key_value_heads": 1},
])
def test_impossible_architecture_is_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        TinyArch(**bad)


def test_tokenizer_config_has_chat_template_and_special_tokens(tiny_checkpoint: Path) -> None:
    cfg = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert "<|start_header_id|>" in cfg["chat_template"]
    assert cfg["bos_token"] == "<|begin_of_text|>"
    assert cfg["eos_token"] == "<|eot_id|>"
    added = {t["content"] for t in json.loads(
        (tiny_checkpoint / "tokenizer.json").read_text())["added_tokens"]}
    assert set(SPECIAL_TOKENS) <= added


def test_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    target = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    before = digests(target)
    with pytest.raises(FileExistsError):
        make_tiny_checkpoint(target, seed=1)
    assert digests(target) == before
    make_tiny_checkpoint(target, seed=1, overwrite=True)
    assert digests(target)["model.safetensors"] != before["model.safetensors"]
    # Nothing but the checkpoint is left behind: no temp or old directories.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_failed_write_leaves_no_partial_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import data_plane.model.make_tiny as make_tiny

    def broken_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(make_tiny, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    assert list(tmp_path.iterdir()) == []
