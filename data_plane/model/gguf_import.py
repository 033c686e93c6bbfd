"""Import a llama.cpp GGUF file as the Hugging Face-style checkpoint a node serves.

GGUF is how most small open models travel without a model hub: one file of metadata and
(usually quantized) tensors. A node serves Hugging Face layout (config.json, safetensors,
tokenizer.json), so `meridian model import-gguf FILE DIR` converts one into the other:

- weights: each tensor dequantized by the `gguf` package (llama.cpp's own reader) and renamed
  to Hugging Face's names. llama.cpp's converter permutes the rows of the Q and K projections
  (its rope kernel rotates adjacent pairs, Hugging Face's rotates the two halves of a head);
  they are permuted back here, or every attention score would be wrong.
- config.json and generation_config.json from the `llama.*` metadata;
- tokenizer.json rebuilt with `tokenizers` from `tokenizer.ggml.*`: byte-level BPE (vocabulary
  and merges), the split `tokenizer.ggml.pre` names (the regexes of llama.cpp's llama-vocab.cpp),
  control tokens as special tokens;
- tokenizer_config.json (bos/eos/pad/unk, add_bos) and the chat template, in tokenizer_config.json
  and as chat_template.jinja (where current transformers writes it).

Weights are written as float32: a dequantized weight (a 16-bit scale times a 4-bit integer plus
a 16-bit minimum) is exact in float32 but not in float16 or bfloat16, so the checkpoint computes
what the GGUF's weights say. The safetensors file is written one tensor at a time, so memory
holds one dequantized tensor, not the model.

What cannot be converted faithfully is refused before anything is written (GgufImportError, one
line): architectures other than llama, quant types gguf cannot dequantize, tokenizers other than
byte-level BPE with a known split, rope scaling other than linear, tensors of unknown names. The
checkpoint is built in a hidden sibling directory and renamed into place, so a failure never
leaves a half-written one.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from data_plane.model.make_tiny import atomic_dir, write_json
from meridian.tokenizer import CHAT_TEMPLATE_FILE

ARCHITECTURES = ("llama",)
TOKENIZER_MODEL = "gpt2"  # llama.cpp's name for byte-level BPE
WEIGHTS_FILE = "model.safetensors"
# llama.cpp's token types (gguf.TokenType): control tokens are special, user-defined ones are
# added tokens matched whole.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GgufImportError(ValueError):
    """The file cannot be converted; the message is one line for the operator."""


class Split(StrEnum):
    """How text is cut into words before BPE merges them (`tokenizer.ggml.pre`)."""

    GPT2 = "gpt2"  # GPT-2's regex
    DIGITS = "digits"  # every digit alone, then GPT-2's regex (StarCoder, SmolLM)
    LLAMA3 = "llama3"  # Llama 3's regex, whole-word vocabulary hits before merges


PRE_TOKENIZERS: dict[str, Split] = {
    "gpt-2": Split.GPT2, "mpt": Split.GPT2, "olmo": Split.GPT2,
    "smollm": Split.DIGITS, "starcoder": Split.DIGITS, "refact": Split.DIGITS, "codeshell": Split.DIGITS,
    "llama-bpe": Split.LLAMA3, "llama3": Split.LLAMA3, "llama-v3": Split.LLAMA3,
}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its GGUF name, ggml type name, Hugging Face shape, and raw data."""

    name: str
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any]
    qtype: Any  # gguf.GGMLQuantizationType


@dataclass(frozen=True)
class GgufFile:
    """The metadata (key → value) and tensors of a GGUF file, read without dequantizing."""

    metadata: dict[str, Any]
    tensors: list[GgufTensor]


def read_gguf(path: Path) -> GgufFile:
    """Open `path` (memory-mapped; nothing is dequantized yet)."""
    import gguf

    if not path.is_file():
        raise GgufImportError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    except (ValueError, OSError, KeyError, IndexError) as e:  # UnicodeDecodeError is a ValueError
        raise GgufImportError(f"{path}: not a readable GGUF file ({e})") from None
    tensors = [GgufTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                          t.data, t.tensor_type) for t in reader.tensors]
    return GgufFile(metadata, tensors)


# --- decisions on the metadata (pure) ------------------------------------------------


@dataclass(frozen=True)
class ImportPlan:
    """What the checkpoint will be: config, tokenizer files, and each tensor's new name."""

    config: dict[str, Any]
    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    chat_template: str | None
    names: dict[str, str]  # GGUF tensor name → Hugging Face name


def plan_import(f: GgufFile) -> ImportPlan:
    """Everything the conversion decides, or GgufImportError before anything is written."""
    config = checkpoint_config(f.metadata, {t.name for t in f.tensors})
    names = {t.name: hf_tensor_name(t.name) for t in f.tensors}
    _check_shapes(f.tensors, names, config)
    _check_dequantizable(f.tensors)
    tokenizer = build_tokenizer(f.metadata)
    template = f.metadata.get("tokenizer.chat_template")
    return ImportPlan(config, tokenizer, tokenizer_config(f.metadata), template if isinstance(template, str) else None,
                      names)


def _get(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GgufImportError(f"the GGUF metadata lacks {key}")
    return meta[key]


def _float(value: Any) -> float:
    """A float32 from the file as the decimal it was written from (9.9999997e-06 → 1e-05)."""
    return float(str(np.float32(value)))


def checkpoint_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json (LlamaForCausalLM) from the `llama.*` metadata."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufImportError(f"architecture {arch!r} cannot be imported (only {', '.join(ARCHITECTURES)})")
    if meta.get("llama.expert_count"):
        raise GgufImportError("mixture-of-experts llama models cannot be imported")
    if "rope_freqs.weight" in tensor_names:
        raise GgufImportError("Llama 3.1-style rope scaling (rope_freqs.weight) cannot be imported")
    hidden, heads = int(_get(meta, "llama.embedding_length")), int(_get(meta, "llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length") or hidden // heads)
    if int(meta.get("llama.rope.dimension_count") or head_dim) != head_dim:
        raise GgufImportError("partial rotary embeddings (rope.dimension_count != head size) cannot be imported")
    tokens = _get(meta, "tokenizer.ggml.tokens")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = [i for i in dict.fromkeys((eos, eot)) if i is not None]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "hidden_size": hidden, "head_dim": head_dim,
        "intermediate_size": int(_get(meta, "llama.feed_forward_length")),
        "max_position_embeddings": int(_get(meta, "llama.context_length")),
        "num_attention_heads": heads,
        "num_hidden_layers": int(_get(meta, "llama.block_count")),
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv") or heads),
        "rms_norm_eps": _float(_get(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        "vocab_size": int(meta.get("llama.vocab_size") or len(tokens)),
    }


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float(_get(meta, "llama.rope.scaling.factor"))}
    raise GgufImportError(f"rope scaling {kind!r} cannot be imported (none or linear)")


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of a llama GGUF tensor."""
    if name in _MODEL_TENSORS:
        return _MODEL_TENSORS[name]
    m = _LAYER.match(name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise GgufImportError(f"tensor {name!r} has no counterpart in a Llama checkpoint")
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"


def unpermute_rope(weights: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair, 2) back to (2, half)."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _check_shapes(tensors: list[GgufTensor], names: dict[str, str], config: dict[str, Any]) -> None:
    """Every tensor the model has, shaped as the config says (the rope permutation needs it)."""
    from data_plane.model.llama import LlamaConfig, UnsupportedModelError
    from data_plane.model.loader import parameter_shapes

    try:
        expected = parameter_shapes(LlamaConfig.from_hf(config))
    except UnsupportedModelError as e:
        raise GgufImportError(f"the torch engine could not run it: {e}") from None
    for t in tensors:
        want = tuple(expected[names[t.name]])
        if t.shape != want:
            raise GgufImportError(f"tensor {t.name} is {list(t.shape)}, the metadata makes it {list(want)}")
    missing = set(expected) - set(names.values()) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    if missing:
        raise GgufImportError(f"the file lacks tensors: {', '.join(sorted(missing)[:4])}")


def _check_dequantizable(tensors: Iterable[GgufTensor]) -> None:
    from gguf.quants import dequantize

    tried: set[str] = set()
    for t in tensors:
        if t.kind in tried:
            continue
        tried.add(t.kind)
        try:
            dequantize(t.data[:1], t.qtype)
        except NotImplementedError:
            raise GgufImportError(f"tensor {t.name}: gguf cannot dequantize {t.kind} weights") from None


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """tokenizer.json from the GGUF's byte-level BPE vocabulary, merges and split."""
    model = meta.get("tokenizer.ggml.model")
    if model != TOKENIZER_MODEL:
        raise GgufImportError(f"tokenizer {model!r} cannot be imported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    split = PRE_TOKENIZERS.get(pre)
    if split is None:
        raise GgufImportError(f"pre-tokenizer {pre!r} cannot be imported (known: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens: list[str] = _get(meta, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _get(meta, "tokenizer.ggml.merges")]
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   ignore_merges=split is Split.LLAMA3))
    except Exception as e:  # tokenizers raises plain Exception for a merge of unknown tokens
        raise GgufImportError(f"the BPE vocabulary and merges do not fit together ({e})") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix")),
                                          use_regex=split is not Split.LLAMA3)
    if split is Split.DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif split is Split.LLAMA3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GgufImportError(f"{len(types)} token types for {len(tokens)} tokens")
    _add_tokens(tok, tokens, types)
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _add_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special tokens (skipped when decoding), user-defined ones added tokens;
    both are matched whole in text instead of being cut up by BPE."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> Any:
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        # Like Llama 3: a plain encode starts with the BOS token.
        return processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                                             special_tokens=[(tokens[bos], bos)])
    return processors.ByteLevel(trim_offsets=False)


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by text, whether BOS is added, the template."""
    tokens: list[str] = _get(meta, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config: dict[str, Any] = {
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


# --- I/O: dequantize and write ---------------------------------------------------------


def import_gguf(gguf_path: Path, out_dir: Path, *, overwrite: bool = False,
                on_tensor: Callable[[int, int], None] | None = None) -> Path:
    """Convert `gguf_path` into a checkpoint at `out_dir` (atomically); returns out_dir.

    `on_tensor(done, total)` is called as each tensor is written. Raises GgufImportError for a
    file it cannot convert, FileExistsError when out_dir is not empty (unless overwrite).
    """
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty")
    f = read_gguf(gguf_path)
    plan = plan_import(f)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        write_json(tmp / "config.json", plan.config)
        write_json(tmp / "generation_config.json", {
            "bos_token_id": plan.config["bos_token_id"], "eos_token_id": plan.config["eos_token_id"]})
        (tmp / "tokenizer.json").write_text(plan.tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
        write_json(tmp / "tokenizer_config.json", plan.tokenizer_config)
        if plan.chat_template is not None:
            (tmp / CHAT_TEMPLATE_FILE).write_text(plan.chat_template, encoding="utf-8")
        entries = [(plan.names[t.name], t.shape) for t in f.tensors]
        write_safetensors(tmp / WEIGHTS_FILE, entries, _dequantized(f.tensors, plan.config, on_tensor))
    return out_dir


def _dequantized(tensors: list[GgufTensor], config: dict[str, Any],
                 on_tensor: Callable[[int, int], None] | None) -> Iterator[np.ndarray[Any, Any]]:
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for done, t in enumerate(tensors, 1):
        w = np.asarray(dequantize(t.data, t.qtype), dtype=np.float32).reshape(t.shape)
        m = _LAYER.match(t.name)
        if m is not None and m.group(2) in heads:
            w = unpermute_rope(w, heads[m.group(2)])
        yield w
        if on_tensor is not None:
            on_tensor(done, len(tensors))


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...]]],
                      arrays: Iterable[np.ndarray[Any, Any]]) -> None:
    """A float32 safetensors file of `entries` (name, shape), whose data `arrays` yields in
    the same order: the header first (every size is known), then one tensor at a time."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in entries:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8 bytes
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape), array in zip(entries, arrays, strict=True):
            data = np.ascontiguousarray(array, dtype="<f4")
            if data.shape != shape:
                raise GgufImportError(f"{name}: dequantized to {data.shape}, expected {shape}")
            out.write(memoryview(data).cast("B"))
