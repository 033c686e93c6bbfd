"""Next-token sampling: greedy, temperature, top-k and nucleus (top-p), reproducible per
seed, with the log-probabilities clients may ask for."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

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
    top_k: int = 0,
) -> int:
    """Choose the next token id from one position's logits [V]."""
    logits = logits.to(torch.float32)
    if temperature <= 0.0:
        return int(torch.argmax(logits).item())
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = (cumulative - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How to sample one row of a batch of logits."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None
    logprobs: int | None


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    # (sampled token's logprob, top alternatives) when the row asked for logprobs.
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def sample_batch(logits: torch.Tensor, rows: list[RowSampling]) -> list[Sampled]:
    """Sample one token per row of logits [S, V]; greedy rows share one argmax.

    Logprobs are those of the model's raw distribution (vLLM's default), whatever the
    temperature or filters used to choose.
    """
    logits = logits.to(torch.float32)
    greedy = torch.argmax(logits, dim=-1).tolist()
    want_logprobs = any(r.logprobs is not None for r in rows)
    log_probs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    out: list[Sampled] = []
    for i, row in enumerate(rows):
        if row.temperature <= 0.0 or row.generator is None:
            token = int(greedy[i])
        else:
            token = sample_next(
                logits[i], temperature=row.temperature, top_p=row.top_p, top_k=row.top_k,
                generator=row.generator,
            )
        if row.logprobs is None or log_probs is None:
            out.append(Sampled(token))
            continue
        lp = log_probs[i]
        top: tuple[tuple[int, float], ...] = ()
        if row.logprobs > 0:
            values, ids = torch.topk(lp, min(row.logprobs, lp.shape[-1]))
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(Sampled(token, float(lp[token]), top))
    return out
