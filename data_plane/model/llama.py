"""A small, readable torch implementation of the Llama architecture (and its Qwen2 and
Mistral cousins), laid out with Hugging Face's module names so that a checkpoint's
state dict loads into it unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


class UnsupportedModelError(ValueError):
    """The checkpoint's config describes something this implementation cannot run."""


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The subset of a Hugging Face config.json that the forward pass depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Build from a parsed config.json; raises UnsupportedModelError for other models."""
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = raw.get("rope_scaling")
        _check_rope_scaling(rope_scaling)
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases, without saying so in its config.
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    kind = _rope_type(scaling)
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with linear or Llama 3.1 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    )
    scaling = config.rope_scaling or {}
    kind = _rope_type(scaling)
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between
        # interpolated smoothly (Llama 3.1's published recipe).
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.to(torch.float32)


class AttentionBackend(Protocol):
    """Where attention reads and writes K/V: one sequence's contiguous cache (the
    reference path) or the engine's paged cache for a whole batch."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store this step's k/v [T, kv_heads, d] and return attention outputs [T, heads, d]
        for the queries q [T, heads, d] (rotary embeddings already applied)."""
        ...

    def step_done(self, num_tokens: int) -> None:
        """Called once after all layers ran."""
        ...


class LoraDelta(Protocol):
    """LoRA contributions of the adapters of a step's tokens (see data_plane.lora)."""

    def delta(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor | None: ...


class KVCache:
    """Keys and values of one sequence, contiguous per layer, with a fixed capacity.

    Shape per layer: [num_kv_heads, capacity, head_dim]. `length` counts the positions
    already written; a forward step appends after it. This is the plain reference
    implementation the paged engine is checked against.
    """

    def __init__(
        self,
        config: LlamaConfig,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (config.num_hidden_layers, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v ([kv_heads, T, head_dim]) after `length`; return all keys/values so far."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} > capacity {self.capacity}")
        self.keys[layer, :, self.length:end] = k
        self.values[layer, :, self.length:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        t = q.shape[0]
        q = q.transpose(0, 1)
        keys, values = self.write(layer, k.transpose(0, 1), v.transpose(0, 1))
        groups = q.shape[0] // keys.shape[0]
        keys = repeat_kv(keys, groups)
        values = repeat_kv(values, groups)
        mask = None
        if t > 1:
            # Query i sits at cache position (past + i) and may see keys up to there.
            past = keys.shape[1] - t
            q_pos = torch.arange(t, device=q.device)[:, None] + past
            k_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
            mask = k_pos <= q_pos
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).transpose(0, 1)

    def step_done(self, num_tokens: int) -> None:
        self.advance(num_tokens)

    def advance(self, n: int) -> None:
        self.length += n

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference does, or bf16 checkpoints drift.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[kv_heads, S, d] -> [kv_heads * groups, S, d], each kv head shared by `groups` q heads."""
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=0)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: AttentionBackend,
        lora: LoraDelta | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = _project(self.q_proj, self.layer, "q_proj", x, lora).view(t, self.num_heads, self.head_dim)
        k = _project(self.k_proj, self.layer, "k_proj", x, lora).view(t, self.num_kv_heads, self.head_dim)
        v = _project(self.v_proj, self.layer, "v_proj", x, lora).view(t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = cache.attend(self.layer, q, k, v)
        return _project(
            self.o_proj, self.layer, "o_proj", out.reshape(t, self.num_heads * self.head_dim), lora
        )


def _project(
    linear: nn.Linear, layer: int, module: str, x: torch.Tensor, lora: LoraDelta | None
) -> torch.Tensor:
    """A projection plus the LoRA contribution of the adapters in this step, if any."""
    y = linear(x)
    if lora is not None:
        delta = lora.delta(layer, module, x)
        if delta is not None:
            y = y + delta.to(y.dtype)
    return y


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraDelta | None) -> torch.Tensor:
        gate = _project(self.gate_proj, self.layer, "gate_proj", x, lora)
        up = _project(self.up_proj, self.layer, "up_proj", x, lora)
        return _project(self.down_proj, self.layer, "down_proj", F.silu(gate) * up, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: AttentionBackend,
        lora: LoraDelta | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM; parameter names match Hugging Face's LlamaForCausalLM."""

    inv_freq: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Explicit CPU device: the model may be built under torch.device("meta") by the
        # loader, but this buffer is computed, not loaded.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache for one sequence of up to `capacity` tokens."""
        return KVCache(self.config, capacity, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference forward: all of `input_ids` [T] from scratch, no cache; logits [T, V]."""
        t = input_ids.shape[0]
        positions = torch.arange(t, device=self.device)
        return self.forward(input_ids.to(self.device), positions, self.new_cache(t), last_only=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: AttentionBackend,
        *,
        last_only: bool = True,
        logits_indices: torch.Tensor | None = None,
        lora: LoraDelta | None = None,
    ) -> torch.Tensor:
        """Run T new tokens through the model, appending their K/V to `cache`.

        input_ids, positions: [T] (one sequence, or a whole batch flattened when `cache`
        is the paged backend). Returns float32 logits: rows `logits_indices` [S, V] if
        given, else the last token's [V], or all [T, V] with last_only=False.
        """
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos = emb.cos().to(self.dtype)
        sin = emb.sin().to(self.dtype)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache, lora)
        cache.step_done(input_ids.shape[0])
        if logits_indices is not None:
            h = h[logits_indices]
        elif last_only:
            h = h[-1]
        return self.lm_head(self.model.norm(h)).to(torch.float32)
