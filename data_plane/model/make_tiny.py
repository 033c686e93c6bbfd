"""Generate a tiny, randomly initialised Llama checkpoint in Hugging Face layout.

The checkpoint has the same file set, tensor names and config keys as a real Llama 3
checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json), so
every code path that serves a real model is exercised on a CPU in milliseconds. The
output is byte-for-byte reproducible for a given seed (and architecture).

`TinyArch` makes it bigger (benchmarks), Qwen2-shaped (attention biases, tied
embeddings) or Llama 3.1-shaped (llama3 rope scaling); its defaults are the tiny model.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, EOT_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN)

TARGET_VOCAB_SIZE = 1000
CORPUS_SENTENCES = 4000

# Llama 3 Instruct's template, verbatim, so prompts are laid out like a real model's.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

_NOUNS = (
    "time year people way day man woman child world life hand part place case week company "
    "system program question work government number night point home water room mother area "
    "money story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment "
    "air teacher force education river mountain forest garden ocean island bridge road train "
    "computer model network server cloud region node token language answer music picture "
    "letter market village kitchen window table chair coffee bread apple dinner weather storm "
    "sun moon star planet engine machine signal voice song dream problem plan field bird fish"
).split()
_VERBS = (
    "is has does says gets makes goes knows takes sees comes thinks looks wants gives uses "
    "finds tells asks works seems feels tries leaves calls keeps starts shows hears plays runs "
    "moves lives believes holds brings happens writes provides sits stands loses pays meets "
    "includes continues learns changes leads understands watches follows stops creates speaks "
    "reads allows adds spends grows opens walks wins offers remembers loves considers appears "
    "buys waits serves dies sends expects builds stays falls cuts reaches kills remains "
    "carries answers explains sings travels counts measures routes caches streams"
).split()
_ADJECTIVES = (
    "good new first last long great little own other old right big high different small large "
    "next early young important few public bad same able quick lazy brown bright dark warm cold "
    "happy sad green blue red yellow quiet loud gentle strong simple clear strange careful "
    "famous modern ancient heavy light fast slow rich poor busy empty full clean wild calm"
).split()
_ADVERBS = (
    "quickly slowly quietly happily always never often sometimes rarely carefully really "
    "almost together again already soon today yesterday tomorrow here there"
).split()
_PREPOSITIONS = "in on at over under near behind beside across through into from with without".split()
_DETERMINERS = "the a this that every some one another my your our their".split()
_NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Iris Jack Karen Liam Maria Noah Olivia Paul "
    "Quinn Rosa Sam Tara Uma Victor Wendy Xavier Yara Zoe"
).split()
_PLACES = (
    "London Paris Tokyo Berlin Madrid Rome Cairo Lima Sydney Toronto Dublin Oslo Seoul Mumbai "
    "Virginia Oregon Frankfurt Amsterdam Singapore"
).split()
_GREETINGS = (
    "Hello!",
    "Hi there.",
    "How are you?",
    "Thank you very much.",
    "Can you help me?",
    "Sure, here is the answer.",
    "I am not sure.",
    "Please explain that again.",
    "Good morning!",
    "What time is it?",
)


def _sentence(rng: random.Random) -> str:
    det = rng.choice(_DETERMINERS)
    shape = rng.randrange(6)
    if shape == 0:
        words = [det.capitalize(), rng.choice(_ADJECTIVES), rng.choice(_NOUNS), rng.choice(_VERBS),
                 rng.choice(_PREPOSITIONS), "the", rng.choice(_NOUNS)]
        return " ".join(words) + "."
    if shape == 1:
        return (f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} {rng.choice(_ADVERBS)} in "
                f"{rng.choice(_PLACES)} with {rng.choice(_NAMES)}.")
    if shape == 2:
        return (f"Why does the {rng.choice(_NOUNS)} {rng.choice(_VERBS).rstrip('s')} "
                f"{rng.choice(_PREPOSITIONS)} {det} {rng.choice(_NOUNS)}?")
    if shape == 3:
        return (f"In {1900 + rng.randrange(125)}, {rng.randrange(2, 1000)} "
                f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}s {rng.choice(_VERBS)} "
                f"{rng.choice(_ADVERBS)}.")
    if shape == 4:
        return rng.choice(_GREETINGS) + " " + (
            f"The {rng.choice(_NOUNS)} is {rng.choice(_ADJECTIVES)}, "
            f"and the {rng.choice(_NOUNS)} is {rng.choice(_ADJECTIVES)}."
        )
    return (f"{det.capitalize()} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} {det} "
            f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}; {rng.choice(_NAMES)} "
            f"{rng.choice(_VERBS)} it {rng.choice(_ADVERBS)}.")


def build_corpus(seed: int, sentences: int = CORPUS_SENTENCES) -> list[str]:
    """Deterministic English-like training text for the tokenizer."""
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(sentences)]


def train_tokenizer(seed: int, vocab_size: int = TARGET_VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE (the Llama 3 / GPT-2 scheme) trained on the built-in corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so any UTF-8 text (emoji, CJK) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(build_corpus(seed), trainer=trainer)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    # Like Llama 3: plain encodes start with <|begin_of_text|>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


@dataclass(frozen=True, slots=True)
class TinyArch:
    """Architecture of a generated checkpoint; the defaults are the tiny test model."""

    model_type: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 176
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Written to config.json as is, e.g. Llama 3.1's {"rope_type": "llama3", "factor": 8.0, ...}.
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("the head dimension must be even (rotary embeddings)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# The tiny model shaped for vLLM's CPU attention, which refuses head_dim 16 and takes 64.
VLLM_CPU_ARCH = TinyArch(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=352)


def tiny_config(
    vocab_size: int, bos_token_id: int, eos_token_ids: list[int], arch: TinyArch | None = None
) -> dict[str, Any]:
    """A Hugging Face config.json (LlamaForCausalLM, or Qwen2ForCausalLM) for the model."""
    arch = arch or TinyArch()
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": arch.intermediate_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": arch.num_attention_heads,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_key_value_heads": arch.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": arch.rope_scaling,
        "rope_theta": 10000.0,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if arch.model_type == "qwen2":
        # Qwen2's config.json as its releases write it: no attention_bias key (the biases
        # are implied by the architecture), its own norm epsilon and rope base.
        for key in ("attention_bias", "head_dim", "mlp_bias", "pretraining_tp"):
            del config[key]
        config.update({
            "architectures": ["Qwen2ForCausalLM"],
            "max_window_layers": arch.num_hidden_layers,
            "model_type": "qwen2",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "sliding_window": arch.max_position_embeddings,
            "use_sliding_window": False,
        })
    return config


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Randomly initialised tensors under Hugging Face Llama (or Qwen2) names."""
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    qkv_bias = config.get("attention_bias", config["model_type"] == "qwen2")
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    vocab = config["vocab_size"]
    std = config["initializer_range"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim)
        if qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = normal(q_dim)
            tensors[p + "self_attn.k_proj.bias"] = normal(kv_dim)
            tensors[p + "self_attn.v_proj.bias"] = normal(kv_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(vocab, hidden)
    return tensors


def tokenizer_config(
    chat_template: str = LLAMA3_CHAT_TEMPLATE, model_max_length: int = 2048
) -> dict[str, Any]:
    """tokenizer_config.json in the shape transformers writes for Llama 3 Instruct."""
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": BOS_TOKEN,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": True,
        "eos_token": EOT_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"{token} missing from the trained vocabulary")
    return int(token_id)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write data as stable, human-readable JSON (sorted keys, so same data, same bytes)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(out_dir: Path, *, overwrite: bool) -> Iterator[Path]:
    """A hidden temporary sibling of out_dir to write into, published as out_dir on success.

    Raises FileExistsError up front if out_dir exists and is not empty, unless overwrite.
    Building next to the destination keeps the final rename on one filesystem: a crash
    leaves only a hidden temp dir, never a half-written directory where readers look.
    """
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_tiny_checkpoint(
    out_dir: Path, seed: int = 0, *, overwrite: bool = False, arch: TinyArch | None = None
) -> Path:
    """Write a tiny Llama checkpoint (or one shaped by `arch`) to out_dir atomically.

    Returns out_dir. Raises FileExistsError if out_dir exists and is not empty, unless
    overwrite is set.
    """
    arch = arch or TinyArch()
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        tokenizer = train_tokenizer(seed)
        ids = {tok: _token_id(tokenizer, tok) for tok in SPECIAL_TOKENS}
        config = tiny_config(
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            bos_token_id=ids[BOS_TOKEN],
            eos_token_ids=[ids[EOS_TOKEN], ids[EOT_TOKEN]],
            arch=arch,
        )
        write_json(tmp / "config.json", config)
        save_file(random_weights(config, seed), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
        write_json(tmp / "tokenizer_config.json",
                   tokenizer_config(model_max_length=arch.max_position_embeddings))
        write_json(tmp / "generation_config.json", {
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": [ids[EOS_TOKEN], ids[EOT_TOKEN]],
        })
    return out_dir


def _replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        src.rename(dst)
        return
    # rename() cannot replace a non-empty directory: move the old one aside first.
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex}"
    dst.rename(old)
    src.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
