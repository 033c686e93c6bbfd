"""A request's state inside the engine's worker thread: its tokens, how many of them
have KV in the cache, which blocks hold that KV, and where its outputs go."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from data_plane.engine.base import GenerationRequest, SamplingParams
from data_plane.engine.kv_cache.block_pool import Block
from data_plane.engine.kv_transfer.payload import KVPayload


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    arrival: int  # admission order; lower is older and wins under memory pressure
    # Everything the model has seen or will see: the prompt, then each sampled token.
    token_ids: list[int]
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    blocks: list[Block] = field(default_factory=list)
    # Hashes of the full blocks of token_ids (extended lazily).
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks already registered in the prefix cache.
    num_cached_blocks: int = 0
    # Prompt tokens served from the prefix cache on first admission.
    cached_prompt_tokens: int = -1
    # Another node's KV for the prompt, until admission writes it into this one's blocks;
    # and how many prompt tokens it supplied (vLLM's external_kv_transfer count).
    pending_kv: KVPayload | None = None
    external_prompt_tokens: int = 0
    generator: torch.Generator | None = None
    lora_slot: int = -1
    # Per-request output plumbing owned by the engine (detokenizer, stop matcher, outbox).
    sink: Any = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def lora_name(self) -> str | None:
        return self.request.lora_name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

