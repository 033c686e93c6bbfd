"""Which LoRA adapters a node can serve, and which of them are resident on the device.

At most max_loras adapters are resident, each in a numbered slot. A request pins its
adapter's slot for as long as it runs (acquire/release); when a new adapter needs a slot,
the least recently used unpinned one is evicted. If every slot is pinned, acquire raises
LoraCapacityError and the scheduler keeps the request waiting.

Threading: a LoraManager is not thread-safe. It is owned by the engine's single worker
thread, which also does the loading (reading safetensors and copying to the device): the
step that first needs an adapter pays for loading it, and the event loop never does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from data_plane.lora.adapter import (
    CONFIG_FILE,
    LoraAdapter,
    LoraCapacityError,
    UnknownLoraError,
    load_adapter,
)
from data_plane.model.llama import LlamaConfig
from meridian.settings.node import NodeSettings


@dataclass(slots=True)
class _Resident:
    adapter: LoraAdapter
    slot: int
    pins: int = 0


class LoraManager:
    """A bounded LRU of loaded adapters with per-adapter pin counts; see the module docstring."""

    def __init__(
        self,
        base: LlamaConfig,
        *,
        modules: Mapping[str, Path] | None = None,
        lora_dir: Path | None = None,
        max_loras: int,
        max_lora_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self._base = base
        self._modules = {name: Path(path) for name, path in (modules or {}).items()}
        self._lora_dir = Path(lora_dir) if lora_dir is not None else None
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._device = torch.device(device)
        self._dtype = dtype
        # Least recently used first.
        self._resident: OrderedDict[str, _Resident] = OrderedDict()
        self._slots: list[str | None] = [None] * max_loras

    @classmethod
    def from_settings(
        cls,
        settings: NodeSettings,
        base: LlamaConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> LoraManager:
        """A manager for the node's lora_modules / lora_dir; dtype is the model's resolved dtype."""
        return cls(
            base,
            modules=settings.lora_modules,
            lora_dir=settings.lora_dir,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
            device=settings.device if device is None else device,
            dtype=dtype,
        )

    # --- what exists -------------------------------------------------------------------

    def _dir_adapters(self) -> dict[str, Path]:
        # Rescanned on every call so adapters dropped into lora_dir are served without a
        # restart. Hidden entries are skipped: that is where atomic writers build theirs.
        if self._lora_dir is None or not self._lora_dir.is_dir():
            return {}
        return {
            p.name: p
            for p in self._lora_dir.iterdir()
            if not p.name.startswith(".") and (p / CONFIG_FILE).is_file()
        }

    def _path(self, name: str) -> Path | None:
        # Explicitly configured modules win over a same-named directory in lora_dir.
        if name in self._modules:
            return self._modules[name]
        # A name is one visible path component: "../x" must not reach outside lora_dir.
        if self._lora_dir is None or not name or name.startswith(".") or "/" in name or "\\" in name:
            return None
        path = self._lora_dir / name
        return path if (path / CONFIG_FILE).is_file() else None

    def names(self) -> list[str]:
        """Names of every adapter this node can serve (configured or found in lora_dir), sorted."""
        return sorted(set(self._modules) | set(self._dir_adapters()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._resident or self._path(name) is not None)

    # --- residency ---------------------------------------------------------------------

    def resident(self) -> tuple[str, ...]:
        """Names of the loaded adapters, least recently used first."""
        return tuple(self._resident)

    def pinned(self) -> tuple[str, ...]:
        """Names of the loaded adapters that running requests hold."""
        return tuple(name for name, r in self._resident.items() if r.pins > 0)

    def slot_of(self, name: str) -> int | None:
        """The slot of a resident adapter, or None when it is not loaded."""
        r = self._resident.get(name)
        return r.slot if r is not None else None

    def adapter(self, slot: int) -> LoraAdapter:
        """The adapter loaded in slot; ValueError for an empty or invalid slot."""
        name = self._slots[slot] if 0 <= slot < self.max_loras else None
        if name is None:
            raise ValueError(f"LoRA slot {slot} holds no adapter")
        return self._resident[name].adapter

    def _victim(self) -> str | None:
        """The least recently used unpinned adapter, or None when all are pinned."""
        return next((name for name, r in self._resident.items() if r.pins == 0), None)

    def can_acquire(self, name: str) -> bool:
        """Whether acquire(name) would find a slot now (no side effects; False for unknown names).

        acquire may still fail with a LoraError if the adapter's files turn out to be bad.
        """
        if name in self._resident:
            return True
        if self._path(name) is None:
            return False
        return len(self._resident) < self.max_loras or self._victim() is not None

    def acquire(self, name: str) -> int:
        """Pin adapter `name`, loading it first if needed, and return its slot.

        Raises UnknownLoraError for a name no adapter has, LoraCapacityError when every slot
        is pinned, and other LoraError subclasses when the adapter's files are unusable (in
        which case nothing is cached or evicted, so a fixed adapter loads on the next try).
        """
        r = self._resident.get(name)
        if r is None:
            path = self._path(name)
            if path is None:
                raise UnknownLoraError(f"LoRA adapter {name!r} does not exist")
            if len(self._resident) >= self.max_loras and self._victim() is None:
                raise LoraCapacityError(
                    f"all {self.max_loras} LoRA slots are in use by running requests"
                )
            # Load before evicting: a bad adapter must not cost a good one its slot.
            adapter = load_adapter(
                path, self._base, name=name, max_rank=self.max_lora_rank,
                device=self._device, dtype=self._dtype,
            )
            r = _Resident(adapter=adapter, slot=self._free_slot())
            self._resident[name] = r
            self._slots[r.slot] = name
        self._resident.move_to_end(name)
        r.pins += 1
        return r.slot

    def _free_slot(self) -> int:
        if None not in self._slots:
            victim = self._victim()
            if victim is None:  # acquire checked this before loading
                raise LoraCapacityError(f"all {self.max_loras} LoRA slots are in use by running requests")
            self.evict(victim)
        return self._slots.index(None)

    def release(self, name: str) -> None:
        """Unpin one acquire of `name`; it stays resident until evicted. ValueError if not pinned."""
        r = self._resident.get(name)
        if r is None or r.pins == 0:
            raise ValueError(f"LoRA adapter {name!r} is not acquired")
        r.pins -= 1

    def evict(self, name: str) -> None:
        """Drop an unpinned resident adapter (e.g. after its files changed). ValueError if pinned."""
        r = self._resident.get(name)
        if r is None:
            return
        if r.pins > 0:
            raise ValueError(f"LoRA adapter {name!r} is in use and cannot be evicted")
        del self._resident[name]
        self._slots[r.slot] = None
