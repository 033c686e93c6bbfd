"""Our Llama computes what Hugging Face transformers computes on the same checkpoint.

transformers is the reference implementation every real checkpoint is published for: if
its LlamaForCausalLM / Qwen2ForCausalLM and ours give the same logits on a checkpoint
in Hugging Face layout, a real Llama 3 or Qwen2 checkpoint served by a node answers as
it would anywhere else.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from data_plane.model.loader import load_model
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint

# Llama 3.1's recipe with a short original context, so that a 300-token prompt reaches
# the positions where the stretched and the interpolated frequencies matter.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
PROMPT_LENGTHS = (1, 17, 300)
# Both implementations run float32 on the CPU; measured differences are ~1e-7, while the
# logits themselves spread ~0.16 and a wrong rope or bias moves them by >1e-3.
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    hf_logging.disable_progress_bar()


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_model(model_dir: Path) -> torch.nn.Module:
    """transformers' own implementation of the checkpoint (eager attention, float32)."""
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] of one unbatched prompt."""
    return model(torch.tensor([ids])).logits[0].float()


def assert_same_logits(model_dir: Path, expected_class: str) -> None:
    ours = load_model(model_dir, dtype="float32", device="cpu")
    reference = hf_model(model_dir)
    assert type(reference).__name__ == expected_class
    for ids in prompts(ours.config.vocab_size):
        expected = hf_logits(reference, ids)
        got = ours.forward_full(torch.tensor(ids))
        assert got.shape == (len(ids), ours.config.vocab_size)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        # Same next-token choice everywhere: greedy decoding would agree token for token.
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_llama_checkpoint_matches_transformers(tiny_checkpoint: Path) -> None:
    assert_same_logits(tiny_checkpoint, "LlamaForCausalLM")


def test_bigger_llama_checkpoint_matches_transformers(tmp_path: Path) -> None:
    arch = TinyArch(hidden_size=128, num_hidden_layers=3, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=344)
    assert_same_logits(make_tiny_checkpoint(tmp_path / "llama", seed=5, arch=arch), "LlamaForCausalLM")


def test_qwen2_checkpoint_with_biases_and_tied_embeddings_matches_transformers(tmp_path: Path) -> None:
    arch = TinyArch(model_type="qwen2", tie_word_embeddings=True)
    assert_same_logits(make_tiny_checkpoint(tmp_path / "qwen2", seed=3, arch=arch), "Qwen2ForCausalLM")


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaled = make_tiny_checkpoint(
        tmp_path / "llama31", seed=3, arch=TinyArch(rope_scaling=LLAMA3_ROPE_SCALING)
    )
    assert_same_logits(scaled, "LlamaForCausalLM")
    # The same weights without scaling give other logits at these lengths: the match
    # above depends on applying the scaling, not only on the weights.
    unscaled = make_tiny_checkpoint(tmp_path / "llama3", seed=3)
    longest = prompts(json.loads((scaled / "config.json").read_text())["vocab_size"])[-1]
    diff = (hf_logits(hf_model(scaled), longest) - hf_logits(hf_model(unscaled), longest)).abs().max().item()
    assert diff > 10 * ATOL
