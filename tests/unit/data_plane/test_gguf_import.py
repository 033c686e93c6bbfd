"""GGUF import: a llama.cpp file becomes a checkpoint that computes what the file says.

The files are written here the way llama.cpp's converter writes them (gguf_files.write_gguf:
gguf's writer, Q/K rows permuted, tokenizer as `tokenizer.ggml.*`) from a tiny checkpoint, so
an F32 file must come back exactly as that checkpoint, and a quantized one must give the logits
transformers' own GGUF loader gives for the same file. What cannot be converted is refused
before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from data_plane.model.gguf_import import GgufImportError, import_gguf
from data_plane.model.loader import load_model
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from meridian.tokenizer import CHAT_TEMPLATE_FILE, ChatTokenizer

# Rows of 64 and 192 values: whole blocks of every quant type tested.
ARCH = TinyArch(intermediate_size=192)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Grüße aus Köln — 東京 🍣 in 2024!",
         "  leading spaces,\ttabs\nand newlines  ", "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"]
PROMPT = [0, 264, 519, 388, 12, 99, 700, 3, 41]


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    hf_logging.disable_progress_bar()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny", seed=5, arch=ARCH)


def _gguf(source: Path, tmp_path: Path, qtype: Q = Q.F32, **bend: object) -> Path:
    d = tmp_path / "gguf"
    d.mkdir(exist_ok=True)
    return write_gguf(source, d / "model.gguf", qtype, **bend)  # type: ignore[arg-type]


def test_an_f32_file_comes_back_as_the_checkpoint_it_was_made_from(source: Path, tmp_path: Path) -> None:
    out = import_gguf(_gguf(source, tmp_path), tmp_path / "out")
    original, imported = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert imported.keys() == original.keys()
    for name, tensor in original.items():
        # Bit for bit, Q and K included: the rope permutation is undone exactly.
        assert (imported[name] == tensor).all(), name
    want, got = json.loads((source / "config.json").read_text()), json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id"):
        assert got[key] == want[key], key


def test_the_tokenizer_and_chat_template_come_back_too(source: Path, tmp_path: Path) -> None:
    out = import_gguf(_gguf(source, tmp_path), tmp_path / "out")
    want, got = ChatTokenizer.from_dir(source), ChatTokenizer.from_dir(out)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text), text
        assert got.decode(got.encode(text), skip_special_tokens=False) == want.decode(want.encode(text),
                                                                                      skip_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert got.apply_chat_template(messages) == want.apply_chat_template(messages)
    assert (got.bos_token, got.eos_token_id) == (want.bos_token, want.eos_token_id)
    # Where current transformers saves it, and where older readers look for it.
    template = (out / CHAT_TEMPLATE_FILE).read_text()
    assert template == json.loads((out / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_the_tokenizer_matches_transformers_reading_the_same_file(source: Path, tmp_path: Path, pre: str) -> None:
    # Each split transformers knows too (it has no SmolLM digit split: the SmolLM2 test checks that one).
    gguf_path = _gguf(source, tmp_path, pre=pre)
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = ChatTokenizer.from_dir(import_gguf(gguf_path, tmp_path / "out"))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_files_give_the_logits_transformers_gives(source: Path, tmp_path: Path, qtype: Q) -> None:
    gguf_path = _gguf(source, tmp_path, qtype)
    ours = load_model(import_gguf(gguf_path, tmp_path / "out"), dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]
        got = ours.forward_full(torch.tensor(PROMPT))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # Quantized is not the same model: the weights moved, or this test would prove nothing.
    exact = load_model(source, dtype="float32")
    with torch.inference_mode():
        assert not torch.allclose(exact.forward_full(torch.tensor(PROMPT)), got, atol=1e-6)


@pytest.mark.parametrize(("bend", "message"), [
    ({"arch": "falcon"}, "architecture 'falcon' cannot be imported"),
    ({"tokenizer_model": "llama"}, "tokenizer 'llama' cannot be imported"),
    ({"pre": "deepseek-llm"}, "pre-tokenizer 'deepseek-llm' cannot be imported"),
    ({"qtype": Q.Q8_1}, "gguf cannot dequantize Q8_1 weights"),
    ({"extra_tensor": "rope_freqs.weight"}, "rope scaling (rope_freqs.weight) cannot be imported"),
    ({"extra_tensor": "blk.0.attn_qkv.weight"}, "tensor 'blk.0.attn_qkv.weight' has no counterpart"),
    ({"drop_tensor": "blk.1.ffn_down.weight"}, "the file lacks tensors: model.layers.1.mlp.down_proj.weight"),
])
def test_what_cannot_be_converted_is_refused_and_nothing_is_written(
    source: Path, tmp_path: Path, bend: dict[str, object], message: str,
) -> None:
    gguf_path = _gguf(source, tmp_path, **bend)
    with pytest.raises(GgufImportError) as refused:
        import_gguf(gguf_path, tmp_path / "out")
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(GgufImportError, match="not a readable GGUF file"):
        import_gguf(bogus, tmp_path / "out")
    with pytest.raises(GgufImportError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_an_interrupted_conversion_leaves_no_checkpoint_behind(source: Path, tmp_path: Path) -> None:
    gguf_path = _gguf(source, tmp_path, Q.Q8_0)

    def interrupt(done: int, total: int) -> None:
        if done == total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_gguf(gguf_path, tmp_path / "out", on_tensor=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]


def test_an_existing_checkpoint_is_kept_unless_overwrite(source: Path, tmp_path: Path) -> None:
    gguf_path = _gguf(source, tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        import_gguf(gguf_path, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    import_gguf(gguf_path, tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").is_file()
