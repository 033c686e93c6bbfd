"""DeploymentSpec: how a deployment's model is served by vLLM on a GPU node (pydantic v2).

An operator (or a deployment template) writes it, a vLLM node reads it (`MERIDIAN_NODE_DEPLOYMENT_SPEC_FILE`, JSON
or YAML) and the vLLM adapter turns it into a `vllm serve` command line. Names refer to
the weight store (`model`, LoRA `source`, draft `model`); the node resolves them to
local directories through its weight cache, so nothing here is a local path.

The lists of known names (quantization methods, KV cache dtypes, load formats, ranks)
are vLLM's, so that a typo is rejected where the spec is written instead of on the GPU
node minutes later.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from meridian.contracts import TOOL_CALL_PARSER_PATTERN

# vLLM's QuantizationMethods that serve pre-quantized or on-the-fly quantized checkpoints
# on NVIDIA GPUs (vllm/model_executor/layers/quantization/__init__.py).
QUANTIZATION_METHODS: tuple[str, ...] = (
    "awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "gptq_bitblas", "bitblas",
    "marlin", "fp8", "ptpc_fp8", "fbgemm_fp8", "modelopt", "modelopt_fp4", "mxfp4",
    "compressed-tensors", "bitsandbytes", "gguf", "experts_int8", "moe_wna16", "torchao",
    "quark", "hqq", "auto-round",
)
# vllm/config/cache.py CacheDType.
KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
)
# vllm/config/load.py LoadFormats that load from a local directory.
LOAD_FORMATS: tuple[str, ...] = (
    "auto", "pt", "safetensors", "npcache", "dummy", "tensorizer", "sharded_state", "gguf",
    "bitsandbytes", "mistral", "runai_streamer", "runai_streamer_sharded", "fastsafetensors",
)
# The spec's fields that take one of the names above.
_KNOWN_VALUES: dict[str, tuple[str, ...]] = {
    "quantization": QUANTIZATION_METHODS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "load_format": LOAD_FORMATS,
}
ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
# vllm/config/lora.py MaxLoRARanks and vllm/config/cache.py BlockSize.
MaxLoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
BlockSize = Literal[1, 8, 16, 32, 64, 128, 256]
# vllm/config/speculative.py SpeculativeMethod (the model-specific *_mtp aliases are "mtp").
SpeculativeMethod = Literal[
    "ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator", "draft_model", "eagle", "eagle3",
    "mtp",
]
# Methods whose drafts come from a separate set of weights that must be named.
_METHODS_WITH_DRAFT_WEIGHTS = frozenset({"medusa", "mlp_speculator", "draft_model", "eagle", "eagle3"})
_NGRAM_METHODS = frozenset({"ngram", "ngram_gpu"})

# Flags the adapter sets itself (addresses, ports, what the deployment fields already
# say): extra_args may not override them, or the node would lose track of its server.
MANAGED_FLAGS: frozenset[str] = frozenset({
    "--host", "--port", "--uds", "--model", "--served-model-name", "--kv-events-config",
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--lora-modules",
    "--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--speculative-config",
    "--quantization", "-q", "--kv-cache-dtype", "--dtype", "--load-format", "--max-model-len",
    "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--block-size",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--api-key", "--root-path",
})

AdapterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


def tool_call_parser(args: Sequence[str]) -> str | None:
    """The tool-call parser `vllm serve` runs with these arguments: `--tool-call-parser`'s
    value (`--flag value` or `--flag=value`) when `--enable-auto-tool-choice` is on, else
    None (vLLM then parses no tool calls from the text). Read as vLLM's parser reads them:
    underscores in a flag's name are dashes, and the last occurrence of a flag wins.

    The node advertises the result to routers, which resume a broken tool-call stream only
    where they can replay its parser; a config file (`--config`) is not read, so a parser
    set only there reads as None, the side that never replays a stream wrongly.
    """
    enabled, parser = False, None
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        flag = flag.replace("_", "-")
        if flag == "--enable-auto-tool-choice" and not eq:
            enabled = True
        elif flag == "--no-enable-auto-tool-choice" and not eq:
            enabled = False
        elif flag == "--tool-call-parser":
            following = args[i + 1] if i + 1 < len(args) else "-"
            parser = value if eq else (None if following.startswith("-") else following)
    return parser if enabled and parser else None


class DeploymentSpecError(ValueError):
    """The spec cannot run on this node (e.g. its parallelism does not fit the GPUs)."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraAdapterSpec(_Spec):
    """A LoRA adapter served next to the base model; requests ask for it as `base:name`."""

    name: AdapterName
    # Weight-store name or URI of the adapter; None when the node provides it itself
    # (its lora_modules / lora_dir settings).
    source: str | None = Field(None, min_length=1, max_length=1000)


class SpeculativeSpec(_Spec):
    """Speculative decoding, rendered as vLLM's --speculative-config JSON."""

    method: SpeculativeMethod
    num_speculative_tokens: int = Field(ge=1, le=64)
    # Weight-store name of the draft model / heads (eagle, medusa, draft_model...).
    model: str | None = Field(None, min_length=1, max_length=1000)
    # vLLM allows 1 or the target's tensor-parallel size.
    draft_tensor_parallel_size: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSpec:
        if self.method in _METHODS_WITH_DRAFT_WEIGHTS and self.model is None:
            raise ValueError(f"speculative method {self.method!r} needs `model` (the draft weights)")
        if self.method not in _METHODS_WITH_DRAFT_WEIGHTS and self.model is not None:
            raise ValueError(f"speculative method {self.method!r} takes no draft `model`")
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method not in _NGRAM_METHODS and lookup != (None, None):
            raise ValueError("prompt_lookup_min/max only apply to the ngram methods")
        lo, hi = lookup
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        return self


class DeploymentSpec(_Spec):
    """Runtime configuration of one deployment on vLLM."""

    name: str = Field(min_length=1, max_length=200)
    # Weight-store name of the base model; the node passes vLLM its local directory.
    model: str = Field(min_length=1, max_length=1000)
    # Name clients use (`model` in requests); defaults to `model`.
    served_model_name: str | None = Field(None, min_length=1, max_length=200)
    # None: every GPU of the node (divided by pipeline_parallel_size).
    tensor_parallel_size: int | None = Field(None, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    dtype: ModelDType = "auto"
    # None: the model's own context length.
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Tokens per KV block; None: vLLM's default for the attention backend (16 on most).
    block_size: BlockSize | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    # On a node without GPUs (vLLM's CPU build) the KV cache lives in host memory: its
    # size in GiB (VLLM_CPU_KVCACHE_SPACE), where a GPU node uses gpu_memory_utilization.
    cpu_kvcache_space_gib: int = Field(4, ge=1, le=4096)
    # Which cores vLLM's CPU build binds its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND):
    # "auto", "nobind" (several replicas sharing a host's cores) or a list such as "0-3".
    cpu_threads_bind: str | None = Field(None, pattern=r"^(auto|nobind|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$")
    load_format: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    loras: list[LoraAdapterSpec] = Field(default_factory=list, max_length=1024)
    # Adapters resident on the GPU at once, and the largest rank any adapter may have.
    max_loras: int = Field(1, ge=1)
    max_lora_rank: MaxLoraRank = 16
    # Adapters kept in CPU memory, ready to swap in; None: max_loras.
    max_cpu_loras: int | None = Field(None, ge=1)
    speculative: SpeculativeSpec | None = None
    # Further `vllm serve` arguments, passed verbatim; may not repeat a managed flag.
    extra_args: list[str] = Field(default_factory=list, max_length=256)
    # Environment variables for the vLLM process (VLLM_*, NCCL_*...).
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("quantization", "kv_cache_dtype", "load_format")
    @classmethod
    def _known_to_vllm(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A value vLLM accepts for the field (a None quantization: the checkpoint's own)."""
        known = _KNOWN_VALUES[info.field_name]
        if value is not None and value not in known:
            raise ValueError(f"unknown {info.field_name} {value!r}; vLLM knows: {', '.join(known)}")
        return value

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, args: list[str]) -> list[str]:
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise ValueError(f"extra_args may not set {flag}: the node manages it (use the spec's fields)")
        parser = tool_call_parser(args)
        if parser is not None and not re.fullmatch(TOOL_CALL_PARSER_PATTERN, parser):
            # The node advertises it to routers, which accept only a short identifier.
            raise ValueError(f"--tool-call-parser {parser[:80]!r} is not a parser name")
        return args

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not key or not (key[0].isalpha() or key[0] == "_") or not key.replace("_", "").isalnum():
                raise ValueError(f"invalid environment variable name {key!r}")
        return env

    @model_validator(mode="after")
    def _consistent(self) -> DeploymentSpec:
        names = [lora.name for lora in self.loras]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"LoRA adapter names must be unique; repeated: {', '.join(duplicates)}")
        if self.served_name in names:
            raise ValueError(f"a LoRA adapter may not be named like the model ({self.served_name!r})")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        if self.max_model_len is not None and not self.enable_chunked_prefill \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len})"
            )
        return self

    @property
    def served_name(self) -> str:
        """The name requests use for the base model."""
        return self.served_model_name or self.model

    @property
    def tool_call_parser(self) -> str | None:
        """The parser vLLM reads the model's tool calls with (None: it reads none)."""
        return tool_call_parser(self.extra_args)

    def parallelism(self, gpu_count: int) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes on a node with `gpu_count` GPUs (0: vLLM's
        CPU build, which runs one process over the host's cores).

        Raises DeploymentSpecError unless tensor x pipeline divides the GPU count (a
        deployment may leave GPUs idle only in whole replicas' worth).
        """
        if gpu_count < 1:
            # vLLM's CPU build: one process uses the host's cores; no GPUs to shard over.
            if (self.tensor_parallel_size or 1) > 1 or self.pipeline_parallel_size > 1:
                raise DeploymentSpecError(
                    "tensor or pipeline parallelism needs GPUs; this node has none (vLLM's CPU build)"
                )
            return 1, 1
        pp = self.pipeline_parallel_size
        tp = self.tensor_parallel_size
        if tp is None:
            if gpu_count % pp:
                raise DeploymentSpecError(
                    f"pipeline_parallel_size {pp} does not divide the node's {gpu_count} GPUs"
                )
            tp = gpu_count // pp
        world = tp * pp
        if world > gpu_count:
            raise DeploymentSpecError(
                f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} needs {world} GPUs; "
                f"this node has {gpu_count}"
            )
        if gpu_count % world:
            raise DeploymentSpecError(
                f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {world} does not divide "
                f"the node's {gpu_count} GPUs"
            )
        spec = self.speculative
        if spec is not None and spec.draft_tensor_parallel_size not in (None, 1, tp):
            raise DeploymentSpecError(
                f"draft_tensor_parallel_size must be 1 or the tensor-parallel size {tp}, "
                f"not {spec.draft_tensor_parallel_size}"
            )
        return tp, pp


def load_deployment_spec(path: Path) -> DeploymentSpec:
    """Read a DeploymentSpec from a JSON or YAML file (by extension; JSON otherwise)."""
    text = Path(path).read_text(encoding="utf-8")
    data: Any = yaml.safe_load(text) if Path(path).suffix in (".yaml", ".yml") else json.loads(text)
    return DeploymentSpec.model_validate(data)
