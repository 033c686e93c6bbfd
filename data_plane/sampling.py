"""Next-token sampling: greedy, temperature, top-k and nucleus (top-p), reproducible per
seed, with the log-probabilities clients may ask for.

Sampling must never fail a batch. Parameters that would break the arithmetic are taken the
way vLLM takes them (a temperature under SAMPLING_EPS is greedy; a nucleus always keeps
its most likely token, however small top_p is), and a row that still cannot be sampled
(non-finite logits) comes back as `SamplingFailed` for that row alone: one sequence's
request must not fail the other sequences of its step, other tenants' included.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

# vLLM's _SAMPLING_EPS: below this a temperature is greedy. Dividing logits by 1e-300 (or
# 5e-324) overflows float32 to inf and the softmax to NaN.
SAMPLING_EPS = 1e-5
_NOT_FINITE = "the logits have no finite maximum (NaN or +inf)"


class SamplingError(ValueError):
    """One row's logits or parameters cannot be sampled from."""


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise SamplingError for parameters no sampler can honour (NaN, out of range)."""
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise SamplingError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise SamplingError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k < 0:
        raise SamplingError(f"top_k must be >= 0 (0 disables it), got {top_k!r}")


def is_greedy(temperature: float) -> bool:
    return temperature < SAMPLING_EPS


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
    """Choose the next token id from one position's logits [V]; SamplingError when the
    parameters are invalid or the logits hold no finite maximum."""
    check_sampling(temperature, top_p, top_k)
    logits = logits.to(torch.float32)
    if not bool(torch.isfinite(logits.max())):
        raise SamplingError(_NOT_FINITE)
    if is_greedy(temperature):
        return int(torch.argmax(logits).item())
    return _sample(logits, temperature, top_p, top_k, generator)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """Sample float32 logits [V] already checked (finite maximum, valid non-greedy values)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p. The first token always stays,
        # explicitly: a top_p below float32's range (1e-300) compares as 0 and would drop it.
        drop = (cumulative - sorted_probs) >= top_p
        drop[0] = False
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


@dataclass(frozen=True, slots=True)
class SamplingFailed:
    """This row could not be sampled; the other rows of the batch were."""

    reason: str


def sample_batch(logits: torch.Tensor, rows: list[RowSampling]) -> list[Sampled | SamplingFailed]:
    """Sample one token per row of logits [S, V]; greedy rows share one argmax.

    Logprobs are those of the model's raw distribution (vLLM's default), whatever the
    temperature or filters used to choose. A row that cannot be sampled is SamplingFailed,
    never an exception that would take its neighbours with it.
    """
    logits = logits.to(torch.float32)
    greedy = torch.argmax(logits, dim=-1).tolist()
    finite = torch.isfinite(logits.max(dim=-1).values).tolist()
    want_logprobs = any(r.logprobs is not None for r in rows)
    log_probs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    out: list[Sampled | SamplingFailed] = []
    for i, row in enumerate(rows):
        try:
            # Checked once here for every row, not again per row inside the sampling.
            if not finite[i]:
                raise SamplingError(_NOT_FINITE)
            check_sampling(row.temperature, row.top_p, row.top_k)
            if is_greedy(row.temperature) or row.generator is None:
                token = int(greedy[i])
            else:
                token = _sample(logits[i], row.temperature, row.top_p, row.top_k, row.generator)
        except (SamplingError, RuntimeError) as exc:  # RuntimeError: torch.multinomial's
            out.append(SamplingFailed(str(exc)))
            continue
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
