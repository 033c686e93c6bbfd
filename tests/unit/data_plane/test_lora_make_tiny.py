"""The tiny LoRA adapter: PEFT layout, reproducible bytes, atomic writes, a visible effect."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli.main import app
from data_plane.lora import LORA_MODULES, load_adapter
from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.llama import LlamaConfig, LlamaForCausalLM
from data_plane.model.loader import load_model, read_config

FILES = ["adapter_config.json", "adapter_model.safetensors"]


def digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_gives_identical_files(tiny_checkpoint: Path, tmp_path: Path) -> None:
    a = make_tiny_lora(tiny_checkpoint, tmp_path / "a", seed=5)
    b = make_tiny_lora(tiny_checkpoint, tmp_path / "b", seed=5)
    assert sorted(digests(a)) == FILES
    assert digests(a) == digests(b)
    c = make_tiny_lora(tiny_checkpoint, tmp_path / "c", seed=6)
    assert digests(c)["adapter_model.safetensors"] != digests(a)["adapter_model.safetensors"]
    assert digests(c)["adapter_config.json"] == digests(a)["adapter_config.json"]


def test_is_a_peft_adapter_for_the_base_model(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = make_tiny_lora(tiny_checkpoint, tmp_path / "lora", seed=0)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (8, 16, "none")
    assert sorted(config["target_modules"]) == sorted(LORA_MODULES)
    assert config["base_model_name_or_path"] == tiny_checkpoint.name
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tuple(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape) == (8, 64)
    assert tuple(tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape) == (64, 8)
    assert len(tensors) == 2 * 7 * 2
    # A "trained" adapter: B is not PEFT's all-zero initialisation.
    assert all(t.abs().sum() > 0 for name, t in tensors.items() if "lora_B" in name)

    adapter = load_adapter(out, LlamaConfig.from_hf(read_config(tiny_checkpoint)), max_rank=8)
    assert adapter.modules == frozenset(LORA_MODULES)
    assert adapter.rank == 8


def test_rank_and_targets_can_be_chosen(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = make_tiny_lora(tiny_checkpoint, tmp_path / "qv", seed=0, rank=2, targets=("v_proj", "q_proj"))
    adapter = load_adapter(out, LlamaConfig.from_hf(read_config(tiny_checkpoint)), max_rank=2)
    assert adapter.modules == {"q_proj", "v_proj"}
    assert adapter.rank == 2
    with pytest.raises(ValueError, match="targets"):
        make_tiny_lora(tiny_checkpoint, tmp_path / "bad", targets=("lm_head",))
    with pytest.raises(ValueError, match="rank"):
        make_tiny_lora(tiny_checkpoint, tmp_path / "bad", rank=0)
    assert not (tmp_path / "bad").exists()


def greedy(model: LlamaForCausalLM, prompt: list[int], n: int = 8) -> list[int]:
    ids = torch.tensor(prompt)
    for _ in range(n):
        ids = torch.cat([ids, model.forward_full(ids)[-1].argmax().view(1)])
    return ids[len(prompt):].tolist()


def test_changes_what_the_model_generates(tiny_checkpoint: Path, tmp_path: Path) -> None:
    base = load_model(tiny_checkpoint)
    adapter = load_adapter(make_tiny_lora(tiny_checkpoint, tmp_path / "lora", seed=0), base.config, max_rank=8)
    merged = load_model(tiny_checkpoint)
    with torch.no_grad():
        for (layer, module), w in adapter.weights.items():
            block = merged.model.layers[layer]
            parent = block.self_attn if hasattr(block.self_attn, module) else block.mlp
            getattr(parent, module).weight += w.scaling * w.b @ w.a

    prompts = [[1, 40, 41, 300], [1, 7, 512, 99, 13], [1, 250]]
    assert all(greedy(base, p) != greedy(merged, p) for p in prompts)


def test_refuses_to_overwrite_unless_asked(tiny_checkpoint: Path, tmp_path: Path) -> None:
    target = make_tiny_lora(tiny_checkpoint, tmp_path / "lora", seed=0)
    before = digests(target)
    with pytest.raises(FileExistsError):
        make_tiny_lora(tiny_checkpoint, target, seed=1)
    assert digests(target) == before
    make_tiny_lora(tiny_checkpoint, target, seed=1, overwrite=True)
    assert digests(target)["adapter_model.safetensors"] != before["adapter_model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["lora"]


def test_failed_write_leaves_no_partial_adapter(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import data_plane.lora.make_tiny as make_tiny

    def broken_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(make_tiny, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        make_tiny_lora(tiny_checkpoint, tmp_path / "lora", seed=0)
    assert list(tmp_path.iterdir()) == []


def test_cli_command(tiny_checkpoint: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "lora"
    r = runner.invoke(app, ["model", "make-tiny-lora", str(tiny_checkpoint), str(out), "--seed", "4", "--rank", "4"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert runner.invoke(app, ["model", "make-tiny-lora", str(tiny_checkpoint), str(out)]).exit_code == 1
    missing_base = runner.invoke(app, ["model", "make-tiny-lora", str(tmp_path / "none"), str(tmp_path / "x")])
    assert missing_base.exit_code == 1
    assert not (tmp_path / "x").exists()
