"""Small GGUF files written the way llama.cpp's converter writes them, from a tiny checkpoint.

`write_gguf` turns a Hugging Face checkpoint (make_tiny's) into a llama GGUF with gguf's own
writer: the `llama.*` hyperparameters, the tokenizer as `tokenizer.ggml.*` (byte-level BPE
vocabulary, merges, token types, special ids, chat template), and the tensors under llama.cpp's
names with the Q and K rows permuted for its rope kernel, as convert_hf_to_gguf.py does,
quantized to the given type where a row divides into its blocks (F32 otherwise, as llama.cpp
keeps norms). The keyword arguments bend the file into ones an import must refuse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import Tokenizer

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    _, _, layer, module = hf.removesuffix(".weight").split(".", 3)
    return f"blk.{layer}.{_LAYER[module]}.weight"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q) -> None:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.ndim == 1 or qtype == Q.F32 or w.shape[-1] % block:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype == Q.Q8_1:  # gguf can neither quantize nor dequantize it: bytes of the right size
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        writer.add_tensor(name, np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)


def write_gguf(checkpoint: Path, path: Path, qtype: Q = Q.F32, *, arch: str = "llama",
               tokenizer_model: str = "gpt2", pre: str = "gpt-2", chat_template: bool = True,
               extra_tensor: str | None = None, drop_tensor: str | None = None) -> Path:
    config: dict[str, Any] = json.loads((checkpoint / "config.json").read_text())
    tok_config: dict[str, Any] = json.loads((checkpoint / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    merges = json.loads(tok.to_str())["model"]["merges"]

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab[tok_config["bos_token"]])
    w.add_eos_token_id(vocab[tok_config["eos_token"]])
    w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(tok_config["chat_template"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for hf, weight in load_file(str(checkpoint / "model.safetensors")).items():
        name = gguf_name(hf)
        if name == drop_tensor:
            continue
        module = name.split(".")[2] if name.startswith("blk.") else ""
        _tensor(w, name, permute(weight, heads[module]) if module in heads else weight, qtype)
    if extra_tensor is not None:
        w.add_tensor(extra_tensor, np.ones(config["head_dim"] // 2, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
