"""Shapes of well-known open models, for model fit (configs from their Hugging Face repos)."""

from __future__ import annotations

from control_plane.placement.fit import ModelSpec

MISTRAL_7B = ModelSpec("mistral-7b", params_b=7.24, layers=32, kv_heads=8, head_dim=128,
                       attention_heads=32, hidden_size=4096)
LLAMA_3_8B = ModelSpec("llama-3-8b", params_b=8.03, layers=32, kv_heads=8, head_dim=128,
                       attention_heads=32, hidden_size=4096)
# Llama 2 13B has no grouped-query attention: 40 KV heads, so its KV cache is large.
LLAMA_2_13B = ModelSpec("llama-2-13b", params_b=13.0, layers=40, kv_heads=40, head_dim=128,
                        attention_heads=40, hidden_size=5120, max_context=4096)
LLAMA_3_70B = ModelSpec("llama-3-70b", params_b=70.6, layers=80, kv_heads=8, head_dim=128,
                        attention_heads=64, hidden_size=8192)


def known_models() -> dict[str, ModelSpec]:
    """The presets by name."""
    return {m.name: m for m in (MISTRAL_7B, LLAMA_3_8B, LLAMA_2_13B, LLAMA_3_70B)}
