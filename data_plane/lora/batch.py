"""Apply several LoRA adapters to one batched forward step (each token its own adapter).

The model runs every token of a step through each projection together; for every
projection it asks `delta(layer, module, x)` and adds the answer to the base output. Work
is vectorised per adapter: one gather, two small matmuls and one scatter-add for all of an
adapter's tokens, so the cost grows with the number of distinct adapters in the step, not
with the number of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from data_plane.lora.adapter import LoraAdapter
from data_plane.lora.manager import LoraManager

NO_LORA = -1


class LoraDelta(Protocol):
    """What the model's forward needs from LoRA: the addend of one projection's output."""

    def delta(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """[N, out_features] to add to the projection of x [N, in_features], or None for nothing."""
        ...


class LoraBatch:
    """Adapters of one step's tokens; implements LoraDelta.

    Built per step from the manager's slots, so it holds the adapters themselves: what the
    manager does to its slots afterwards cannot change a step in flight.
    """

    __slots__ = ("_groups", "num_tokens")

    def __init__(self, groups: Sequence[tuple[LoraAdapter, torch.Tensor | None]], num_tokens: int) -> None:
        # (adapter, row indices); rows None means every token of the step uses the adapter.
        self._groups = tuple(groups)
        self.num_tokens = num_tokens

    @classmethod
    def build(
        cls,
        manager: LoraManager,
        slot_ids: Sequence[int] | torch.Tensor,
        *,
        device: torch.device | str | None = None,
    ) -> LoraBatch:
        """From each token's slot id (-1 for no adapter), in the order of the step's rows.

        The slots must be held (acquired) by the requests the tokens belong to.
        """
        slots = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
        rows_by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot != NO_LORA:
                rows_by_slot.setdefault(slot, []).append(row)
        target = torch.device(device) if device is not None else None
        groups: list[tuple[LoraAdapter, torch.Tensor | None]] = []
        for slot, rows in rows_by_slot.items():
            adapter = manager.adapter(slot)
            if len(rows) == len(slots):
                groups.append((adapter, None))
                continue
            where = target if target is not None else _device_of(adapter)
            groups.append((adapter, torch.tensor(rows, dtype=torch.long, device=where)))
        return cls(groups, len(slots))

    @property
    def is_empty(self) -> bool:
        """True when no token of the step uses an adapter."""
        return not self._groups

    @property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        return tuple(adapter for adapter, _ in self._groups)

    def delta(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """Sum of the adapters' contributions for x [N, in]: [N, out], zero in rows without one.

        None when no adapter in the step touches this projection, so the model can skip the add.
        """
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"LoRA batch built for {self.num_tokens} tokens, got {x.shape[0]} rows")
        out: torch.Tensor | None = None
        for adapter, rows in self._groups:
            weights = adapter.get(layer, module)
            if weights is None:
                continue
            if rows is None:
                # The only group: no gather, no scatter.
                return weights.delta(x).to(x.dtype)
            part = weights.delta(x.index_select(0, rows))
            if out is None:
                out = x.new_zeros((x.shape[0], weights.out_features))
            out.index_add_(0, rows, part.to(x.dtype))
        return out


def _device_of(adapter: LoraAdapter) -> torch.device:
    return next(iter(adapter.weights.values())).a.device
