"""Load a PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors) and
check it against the base model it will run on.

Only plain LoRA on the seven linear projections of a decoder layer is supported; anything
else an adapter may carry (embedding or lm_head adapters, modules_to_save, DoRA, LoRA
biases) is refused with a typed error rather than silently ignored, since serving an
adapter without part of its weights would give wrong outputs that look plausible.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from data_plane.model.llama import LlamaConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES: tuple[str, ...] = ATTENTION_MODULES + MLP_MODULES

# PEFT's shorthand for "every linear layer but the output head".
ALL_LINEAR = "all-linear"

_PEFT_PREFIX = "base_model.model."
# `.default` appears when a state dict was taken from a live PeftModel rather than saved
# with save_pretrained; both spellings name the same tensor.
_LAYER_TENSOR = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+)"
    r"\.(?P<kind>lora_A|lora_B)(?:\.default)?\.weight"
)


class LoraError(Exception):
    """Base of every LoRA error: a bad adapter, an unknown name, no room to load one."""


class LoraFilesError(LoraError):
    """The adapter directory, its config or its weights are missing or unreadable."""


class LoraConfigError(LoraError):
    """adapter_config.json asks for something invalid or that this runtime does not do."""


class UnsupportedLoraModuleError(LoraError):
    """The adapter targets a module other than the seven linear projections of a layer."""


class LoraRankError(LoraError):
    """The adapter's rank exceeds the node's max_lora_rank."""


class LoraShapeError(LoraError):
    """The adapter's tensors do not fit the base model (another model's adapter, or corrupt)."""


class UnknownLoraError(LoraError, LookupError):
    """No adapter of that name is configured on this node."""


class LoraCapacityError(LoraError):
    """Every resident adapter slot is pinned by a running request; try again later."""


@dataclass(frozen=True, slots=True)
class LoraAdapterConfig:
    """The fields of a PEFT adapter_config.json that decide how the adapter is applied."""

    r: int
    lora_alpha: float
    # A list of module names (matched as suffixes of the full module name) or a regex
    # matched against the full name, exactly as PEFT interprets it.
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    exclude_modules: tuple[str, ...] | str | None = None
    base_model_name_or_path: str | None = None

    @classmethod
    def from_peft(cls, raw: dict[str, Any]) -> LoraAdapterConfig:
        """Parse a PEFT adapter_config.json; LoraConfigError for what cannot be served."""
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise LoraConfigError(f"peft_type {peft_type!r} is not supported (only LORA)")
        if raw.get("bias", "none") != "none":
            raise LoraConfigError(f"bias {raw['bias']!r} is not supported (only 'none')")
        if raw.get("fan_in_fan_out", False):
            raise LoraConfigError("fan_in_fan_out adapters (Conv1D models) are not supported")
        if raw.get("use_dora", False):
            raise LoraConfigError("DoRA adapters are not supported")
        if raw.get("lora_bias", False):
            raise LoraConfigError("adapters with LoRA biases are not supported")
        if raw.get("modules_to_save"):
            raise UnsupportedLoraModuleError(
                f"modules_to_save {raw['modules_to_save']!r} is not supported: only LoRA "
                "weights on the attention and MLP projections can be served"
            )
        try:
            r = int(raw.get("r", 8))
            alpha = float(raw.get("lora_alpha", 8))
            rank_pattern = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
            alpha_pattern = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise LoraConfigError(f"invalid rank or alpha in {CONFIG_FILE}: {e}") from None
        if r <= 0 or any(v <= 0 for v in rank_pattern.values()):
            raise LoraConfigError(f"LoRA rank must be positive, got r={r} rank_pattern={rank_pattern}")
        return cls(
            r=r,
            lora_alpha=alpha,
            target_modules=_module_spec(raw.get("target_modules"), "target_modules", required=True),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=rank_pattern,
            alpha_pattern=alpha_pattern,
            exclude_modules=_module_spec(raw.get("exclude_modules"), "exclude_modules"),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
        )

    def rank_for(self, module_key: str) -> int:
        """The rank PEFT gives module_key (rank_pattern overrides r)."""
        pattern = _pattern_key(self.rank_pattern, module_key)
        return self.rank_pattern[pattern] if pattern is not None else self.r

    def scaling_for(self, module_key: str) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, for module_key."""
        pattern = _pattern_key(self.alpha_pattern, module_key)
        alpha = self.alpha_pattern[pattern] if pattern is not None else self.lora_alpha
        r = self.rank_for(module_key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module_key: str) -> bool:
        """Whether PEFT would put a LoRA layer on module_key (full name, e.g. model.layers.0.mlp.up_proj)."""
        if self.exclude_modules is not None and _spec_matches(self.exclude_modules, module_key):
            return False
        return _spec_matches(self.target_modules, module_key)


def _module_spec(value: Any, name: str, *, required: bool = False) -> tuple[str, ...] | str | None:
    if value is None:
        if required:
            raise LoraConfigError(f"{CONFIG_FILE} has no {name}")
        return None
    if isinstance(value, str):
        if value == ALL_LINEAR:
            return LORA_MODULES
        try:
            re.compile(value)
        except re.error as e:
            raise LoraConfigError(f"{name} {value!r} is not a valid regex: {e}") from None
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise LoraConfigError(f"{name} must be a list of module names or a regex, got {value!r}")


def _spec_matches(spec: tuple[str, ...] | str, key: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith("." + name) for name in spec)


def _pattern_key(patterns: dict[str, Any], key: str) -> str | None:
    # PEFT's get_pattern_key: the first pattern that matches a whole trailing name part.
    return next((p for p in patterns if re.match(rf"(^|.*\.){p}$", key)), None)


def module_key(layer: int, module: str) -> str:
    """The Hugging Face name of a projection, e.g. model.layers.3.self_attn.q_proj."""
    parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{parent}.{module}"


def module_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-capable projection of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (hidden, q_dim),
        "k_proj": (hidden, kv_dim),
        "v_proj": (hidden, kv_dim),
        "o_proj": (q_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _model_module_keys(config: LlamaConfig) -> list[str]:
    """Names of the base model's modules an adapter config could target."""
    keys = ["model.embed_tokens", "lm_head", "model.norm"]
    for layer in range(config.num_hidden_layers):
        keys += [module_key(layer, m) for m in LORA_MODULES]
        keys += [f"model.layers.{layer}.input_layernorm", f"model.layers.{layer}.post_attention_layernorm"]
    return keys


# eq=False: comparing tensors elementwise has no single truth value.
@dataclass(frozen=True, slots=True, eq=False)
class LoraModuleWeights:
    """One projection's adapter: delta(x) = scaling * x @ A.T @ B.T."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.b.shape[0])

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution for rows x [n, in_features] -> [n, out_features]."""
        if x.dtype != self.a.dtype:
            x = x.to(self.a.dtype)
        # Scale the [n, rank] intermediate: the smallest tensor on the way.
        return torch.mm(torch.mm(x, self.a.t()) * self.scaling, self.b.t())


# eq=False: comparing tensors elementwise has no single truth value.
@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """A loaded adapter: A/B tensors per (layer, module), already on the serving device."""

    name: str
    path: Path
    config: LoraAdapterConfig
    weights: dict[tuple[int, str], LoraModuleWeights]

    def get(self, layer: int, module: str) -> LoraModuleWeights | None:
        """The adapter on that projection, or None when it leaves it untouched."""
        return self.weights.get((layer, module))

    @property
    def rank(self) -> int:
        """The largest rank of any of its modules."""
        return max(w.rank for w in self.weights.values())

    @property
    def modules(self) -> frozenset[str]:
        """Projection names it adapts in at least one layer."""
        return frozenset(m for _, m in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def read_adapter_config(path: Path) -> LoraAdapterConfig:
    """Parse path/adapter_config.json; LoraFilesError when missing or not JSON."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise LoraFilesError(f"{file} not found" if Path(path).is_dir() else f"adapter directory {path} not found")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraFilesError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise LoraFilesError(f"{file} is not a JSON object")
    return LoraAdapterConfig.from_peft(raw)


def _check_targets(config: LoraAdapterConfig, base: LlamaConfig) -> None:
    matched = [k for k in _model_module_keys(base) if config.targets(k)]
    unsupported = sorted({k.rsplit(".", 1)[-1] for k in matched if not k.endswith(LORA_MODULES)})
    if unsupported:
        raise UnsupportedLoraModuleError(
            f"adapter targets {unsupported}; only {list(LORA_MODULES)} are supported"
        )
    if not matched:
        raise UnsupportedLoraModuleError(
            f"target_modules {config.target_modules!r} match no module of the base model "
            f"(supported: {list(LORA_MODULES)})"
        )


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        hint = " (only safetensors adapters are supported)" if (file.parent / "adapter_model.bin").exists() else ""
        raise LoraFilesError(f"{file} not found{hint}")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a Mapping
    except (OSError, SafetensorError) as e:
        raise LoraFilesError(f"cannot read {file}: {e}") from None


def _parse_key(name: str) -> tuple[int, str, str]:
    """(layer, module, 'lora_A' | 'lora_B') of a tensor name; typed errors for the rest."""
    key = name.removeprefix(_PEFT_PREFIX)
    m = _LAYER_TENSOR.fullmatch(key)
    if m is None:
        if "embed_tokens" in key or "lm_head" in key or "lora_embedding" in key:
            raise UnsupportedLoraModuleError(f"tensor {name!r}: embedding and lm_head adapters are not supported")
        raise UnsupportedLoraModuleError(f"unexpected tensor {name!r} in {WEIGHTS_FILE}")
    module = m["module"]
    expected_parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
    if module not in LORA_MODULES or m["parent"] != expected_parent:
        raise UnsupportedLoraModuleError(
            f"tensor {name!r}: module {m['parent']}.{module} is not one of {list(LORA_MODULES)}"
        )
    return int(m["layer"]), module, m["kind"]


def load_adapter(
    path: Path,
    base: LlamaConfig,
    *,
    name: str | None = None,
    max_rank: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Load and validate a PEFT LoRA adapter for `base`; raises a LoraError subclass if unusable."""
    path = Path(path)
    config = read_adapter_config(path)
    _check_targets(config, base)
    # Refuse before reading weights that may be large; tensors are checked one by one below.
    if config.r > max_rank:
        raise LoraRankError(f"adapter rank {config.r} exceeds max_lora_rank {max_rank}")
    tensors = _read_tensors(path / WEIGHTS_FILE)

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        layer, module, kind = _parse_key(tensor_name)
        if layer >= base.num_hidden_layers:
            raise LoraShapeError(
                f"tensor {tensor_name!r}: layer {layer} but the base model has {base.num_hidden_layers} layers"
            )
        pairs.setdefault((layer, module), {})[kind] = tensor
    if not pairs:
        raise LoraFilesError(f"{path / WEIGHTS_FILE} holds no LoRA weights")

    shapes = module_shapes(base)
    weights: dict[tuple[int, str], LoraModuleWeights] = {}
    for (layer, module), pair in sorted(pairs.items()):
        where = module_key(layer, module)
        if set(pair) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(pair)).pop()
            raise LoraShapeError(f"{where}: {missing} weight is missing")
        a, b = pair["lora_A"], pair["lora_B"]
        in_features, out_features = shapes[module]
        rank = config.rank_for(where)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraShapeError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a LoRA pair"
            )
        if a.shape[0] > max_rank:
            raise LoraRankError(f"{where}: rank {a.shape[0]} exceeds max_lora_rank {max_rank}")
        if a.shape[0] != rank:
            raise LoraShapeError(f"{where}: tensors have rank {a.shape[0]} but {CONFIG_FILE} says {rank}")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoraShapeError(
                f"{where}: adapter maps {a.shape[1]} -> {b.shape[0]} features but the base "
                f"projection maps {in_features} -> {out_features} (adapter for another model?)"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoraShapeError(f"{where}: LoRA weights must be floating point, got {a.dtype}/{b.dtype}")
        weights[(layer, module)] = LoraModuleWeights(
            a=a.to(device=device, dtype=dtype).contiguous(),
            b=b.to(device=device, dtype=dtype).contiguous(),
            scaling=config.scaling_for(where),
        )
    return LoraAdapter(name=name or path.name, path=path, config=config, weights=weights)
