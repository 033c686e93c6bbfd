"""Next-token sampling: greedy, temperature and nucleus (top-p), reproducible per seed."""

from __future__ import annotations

import secrets

import torch


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request random stream: a given seed replays the same choices."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    return gen


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
) -> int:
    """Choose the next token id from one position's logits [V]."""
    logits = logits.to(torch.float32)
    if temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = (cumulative - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
