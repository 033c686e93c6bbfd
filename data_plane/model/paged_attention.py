"""Paged attention for a batch of sequences in plain torch.

K/V live in one pre-allocated tensor per layer, addressed by slot (block id * block
size + offset), so a sequence's KV needs no contiguous memory and full blocks can be
shared between sequences with the same prefix. Each step, `PagedAttention` carries
the batch's layout: where every new token's K/V goes (slot_mapping), the one-token
queries (decodes) attended together over their gathered, padded contexts, and the
multi-token chunks (prefills) attended one by one with a causal mask offset by what
is already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data_plane.model.llama import LlamaConfig


class PagedKVCache:
    """The engine's KV memory: [layers, num_blocks * block_size, kv_heads, head_dim] each for K and V."""

    def __init__(
        self,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (config.num_hidden_layers, num_blocks * block_size, config.num_key_value_heads,
                 config.head_dim)
        # Zeros, not empty: padded decode slots are read (then masked) and must be finite.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


@dataclass(slots=True)
class PrefillSpan:
    row: int  # first row of this chunk in the flattened batch
    num_tokens: int
    start: int  # position of the chunk's first token in its sequence
    slots: torch.Tensor  # [start + num_tokens] slots of the whole context, in order


@dataclass(slots=True)
class PagedAttention:
    """One step's attention layout; rows 0..num_decodes-1 are the one-token queries."""

    kv: PagedKVCache
    slot_mapping: torch.Tensor  # [N]
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B * Lmax], row-major [B, Lmax]
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax], 0 where a key may be seen, -inf past the end
    prefills: list[PrefillSpan]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kc = self.kv.keys[layer]
        vc = self.kv.values[layer]
        kc.index_copy_(0, self.slot_mapping, k)
        vc.index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        b = self.num_decodes
        if b:
            assert self.decode_slots is not None and self.decode_mask is not None
            kv_heads, head_dim = kc.shape[1], kc.shape[2]
            length = self.decode_mask.shape[-1]
            # index_select, not fancy indexing: the gather is this step's main memory cost.
            kd = kc.index_select(0, self.decode_slots).view(b, length, kv_heads, head_dim).transpose(1, 2)
            vd = vc.index_select(0, self.decode_slots).view(b, length, kv_heads, head_dim).transpose(1, 2)
            # Grouped-query attention without repeating K/V: the query heads sharing a KV
            # head become that head's queries, [B, kvh, groups, d].
            qd = q[:b].reshape(b, kv_heads, -1, head_dim)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask)
            out[:b] = od.reshape(b, -1, head_dim)
        for span in self.prefills:
            rows = slice(span.row, span.row + span.num_tokens)
            qp = q[rows].transpose(0, 1)  # [H, n, d]
            kp = kc.index_select(0, span.slots).transpose(0, 1)  # [kvh, ctx, d]
            vp = vc.index_select(0, span.slots).transpose(0, 1)
            if span.start == 0:
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                q_pos = torch.arange(span.num_tokens, device=q.device)[:, None] + span.start
                k_pos = torch.arange(kp.shape[1], device=q.device)[None, :]
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=k_pos <= q_pos, enable_gqa=True
                )
            out[rows] = op.transpose(0, 1)
        return out

    def step_done(self, num_tokens: int) -> None:
        return None
