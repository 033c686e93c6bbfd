"""LoRA adapters for the built-in torch engine: PEFT loading, residency, batched deltas."""

from data_plane.lora.adapter import (
    LORA_MODULES,
    LoraAdapter,
    LoraAdapterConfig,
    LoraCapacityError,
    LoraConfigError,
    LoraError,
    LoraFilesError,
    LoraModuleWeights,
    LoraRankError,
    LoraShapeError,
    UnknownLoraError,
    UnsupportedLoraModuleError,
    load_adapter,
)
from data_plane.lora.batch import NO_LORA, LoraBatch, LoraDelta
from data_plane.lora.manager import LoraManager

__all__ = [
    "LORA_MODULES",
    "NO_LORA",
    "LoraAdapter",
    "LoraAdapterConfig",
    "LoraBatch",
    "LoraCapacityError",
    "LoraConfigError",
    "LoraDelta",
    "LoraError",
    "LoraFilesError",
    "LoraManager",
    "LoraModuleWeights",
    "LoraRankError",
    "LoraShapeError",
    "UnknownLoraError",
    "UnsupportedLoraModuleError",
    "load_adapter",
]
