"""Model fit: how many GPUs of a SKU one replica of a model needs, and what it then serves.

Memory (per GPU, tensor-parallel degree t):

    weights/t + KV/t + fragmentation × (weights/t + KV/t) + fixed  ≤  utilisation × GPU memory

- weights = params × bytes per weight of the quantisation (bf16/fp16 2, fp8/int8 1,
  int4/AWQ/GPTQ 0.5625: 4-bit packed weights plus group-128 fp16 scales and zeros, and
  the embeddings and LM head that stay in 16 bit);
- KV = 2 (K and V) × layers × kv_heads × head_dim × KV bytes × max_context × target
  concurrent sequences: the cache is sized for the worst case, every sequence at full length.
  When t exceeds kv_heads, each GPU holds a whole copy of one KV head (vLLM replicates them);
- fixed: CUDA context, captured CUDA graphs, NCCL buffers and the activation peak of one
  prefill chunk, per GPU; fragmentation: the allocator's slack, as a fraction;
- utilisation is vLLM's gpu_memory_utilization: the share of the GPU the engine may use.

Tensor-parallel rule: t is a power of two, at most 8 (one host: tensor parallelism across hosts
is not worth its latency), t divides the attention heads (when known), and t divides kv_heads
or is a multiple of it (KV heads are then replicated). The smallest t that fits wins.

Throughput (a roofline):
- decode: one step reads the GPU's share of the weights and the batch's KV cache (sequences
  are on average `avg_context_fraction` of max_context long) at an achievable fraction of HBM
  bandwidth, or is compute-bound when the batch is large; tensor parallelism adds two
  all-reduces per layer (latency + bytes over the interconnect, which is where PCIe parts
  lose). A step yields one token per sequence of the batch (the target concurrency);
- prefill: 2 × params FLOPs per token at an achievable fraction (MFU) of dense bf16 FLOP/s
  (quantised weights are dequantised to bf16, so no fp8 speed-up is assumed), plus the same
  all-reduce traffic per token (prompts go through in chunks, which amortise the latency).

A replica's serving throughput (what placement covers demand with) is its decode rate:
generated tokens per second at the target concurrency.

Prefill/decode pools (`size_pools`): a disaggregated deployment runs prompts on prefill
replicas and generation on decode replicas. For a mix of P prompt and G generated tokens per
request, demand D generated tokens/s is D/G requests/s, so D·P/G prompt tokens/s for the
prefill pool (compute-bound: the prefill rate above) and D generated tokens/s for the decode
pool (memory-bound: the decode rate above, now free of prefill interference). Prefill
replicas per decode replica are therefore (P/G) × decode rate / prefill rate: prompt-heavy
mixes and bandwidth-rich, FLOP-poor SKUs want more prefill. Attention's own FLOPs (quadratic
in the prompt) are left out, as in the prefill rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from providers.offerings import Offering
from providers.skus import SKUS, GpuSku

GIB = 1024**3

# Bytes stored per parameter, by weight format.
BYTES_PER_WEIGHT: dict[str, float] = {
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5625,
    "awq": 0.5625,
    "gptq": 0.5625,
}
# Bytes per cached K or V element, by KV cache dtype.
KV_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0}
TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a model and the workload one replica must hold in memory."""

    name: str
    params_b: float  # parameters, billions
    layers: int
    kv_heads: int
    head_dim: int
    quantization: str = "bf16"  # key of BYTES_PER_WEIGHT
    kv_cache_dtype: str = "bf16"  # key of KV_BYTES
    max_context: int = 8192
    target_concurrent_seqs: int = 16
    attention_heads: int | None = None  # constrains the TP degree when known
    hidden_size: int | None = None  # estimated from params and layers when unknown

    def __post_init__(self) -> None:
        if self.quantization not in BYTES_PER_WEIGHT:
            raise ValueError(f"unknown quantization {self.quantization!r}; one of {sorted(BYTES_PER_WEIGHT)}")
        if self.kv_cache_dtype not in KV_BYTES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; one of {sorted(KV_BYTES)}")
        if min(self.params_b, self.layers, self.kv_heads, self.head_dim, self.max_context) <= 0:
            raise ValueError("params_b, layers, kv_heads, head_dim and max_context must be positive")
        if self.target_concurrent_seqs < 1:
            raise ValueError("target_concurrent_seqs must be at least 1")

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights in the model's quantisation."""
        return self.params_b * 1e9 * BYTES_PER_WEIGHT[self.quantization]

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token occupies across all layers and KV heads."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * KV_BYTES[self.kv_cache_dtype]

    @property
    def kv_bytes(self) -> float:
        """KV cache bytes reserved for target_concurrent_seqs sequences of max_context tokens."""
        return self.kv_bytes_per_token * self.max_context * self.target_concurrent_seqs

    @property
    def hidden(self) -> int:
        """Hidden size; when unknown, from params ≈ 12 × layers × hidden² (attention + MLP)."""
        if self.hidden_size is not None:
            return self.hidden_size
        return round(math.sqrt(self.params_b * 1e9 / (12 * self.layers)))


@dataclass(frozen=True, slots=True)
class FitAssumptions:
    """The documented constants of the memory and roofline model."""

    gpu_memory_utilization: float = 0.9
    fixed_overhead_gib: float = 1.5  # per GPU: CUDA context, CUDA graphs, NCCL, prefill activations
    fragmentation: float = 0.02  # allocator slack, fraction of the weights + KV on a GPU
    decode_hbm_efficiency: float = 0.6  # achievable share of peak HBM bandwidth in decode
    prefill_mfu: float = 0.5  # achievable share of peak dense FLOP/s
    avg_context_fraction: float = 0.5  # mean sequence length during decode, share of max_context
    prefill_chunk_tokens: int = 2048  # prompts are prefilled in chunks: all-reduce latency is per chunk
    allreduce_latency_us: Mapping[str, float] = field(
        default_factory=lambda: {"nvlink": 10.0, "pcie": 30.0}
    )
    max_tp: int = 8


DEFAULT_ASSUMPTIONS = FitAssumptions()


@dataclass(frozen=True, slots=True)
class SkuFit:
    """One replica of a model on one SKU: its TP degree, memory budget and throughput."""

    sku: str
    tp: int
    weights_gib_per_gpu: float
    kv_gib_per_gpu: float
    overhead_gib_per_gpu: float
    usable_gib_per_gpu: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float

    @property
    def used_gib_per_gpu(self) -> float:
        return self.weights_gib_per_gpu + self.kv_gib_per_gpu + self.overhead_gib_per_gpu


@dataclass(frozen=True, slots=True)
class ModelFit:
    """A model's fit on every SKU it fits on (SKUs it does not fit on are absent)."""

    model: ModelSpec
    per_sku: Mapping[str, SkuFit]

    def replicas_per_instance(self, offering: Offering) -> int:
        """Replicas one instance of the offering hosts (0 when the model does not fit on it)."""
        fit = self.per_sku.get(offering.sku)
        return offering.gpu_count // fit.tp if fit else 0

    def cost_per_million_tokens(self, offering: Offering, spot: bool = False) -> float | None:
        """USD per million generated tokens on this offering at full load; None when not possible."""
        fit = self.per_sku.get(offering.sku)
        price = offering.spot_price_per_hour if spot else offering.price_per_hour
        replicas = self.replicas_per_instance(offering)
        if fit is None or price is None or replicas == 0:
            return None
        tokens_per_hour = replicas * fit.decode_tokens_per_s * 3600.0
        return price / tokens_per_hour * 1e6


def tp_degree_allowed(model: ModelSpec, tp: int, assumptions: FitAssumptions = DEFAULT_ASSUMPTIONS) -> bool:
    """Whether the TP rule (power of two ≤ max_tp, heads divisible, KV heads split or replicated) allows tp."""
    if tp not in TP_DEGREES or tp > assumptions.max_tp:
        return False
    if model.attention_heads is not None and model.attention_heads % tp:
        return False
    return model.kv_heads % tp == 0 or tp % model.kv_heads == 0


def _allreduce_seconds(model: ModelSpec, sku: GpuSku, tp: int, tokens: int, a: FitAssumptions) -> float:
    """Two ring all-reduces of the activations per layer, for `tokens` tokens at once."""
    if tp == 1:
        return 0.0
    message = tokens * model.hidden * 2.0  # bf16 activations
    wire = message * 2.0 * (tp - 1) / tp  # ring all-reduce moves 2(t-1)/t of the message per GPU
    latency = a.allreduce_latency_us.get(sku.interconnect, 30.0) * 1e-6
    return 2 * model.layers * (latency + wire / (sku.interconnect_gbps * 1e9))


def fit_on_sku(
    model: ModelSpec, sku: GpuSku, tp: int, assumptions: FitAssumptions = DEFAULT_ASSUMPTIONS
) -> SkuFit | None:
    """The fit of one replica at exactly this TP degree, or None when it does not fit in memory."""
    a = assumptions
    if not tp_degree_allowed(model, tp, a):
        return None
    weights = model.weight_bytes / tp
    kv_heads_per_gpu = math.ceil(model.kv_heads / tp)
    kv_per_token_per_gpu = model.kv_bytes_per_token * kv_heads_per_gpu / model.kv_heads
    kv = kv_per_token_per_gpu * model.max_context * model.target_concurrent_seqs
    overhead = a.fragmentation * (weights + kv) + a.fixed_overhead_gib * GIB
    usable = a.gpu_memory_utilization * sku.memory_gib * GIB
    if weights + kv + overhead > usable:
        return None

    batch = model.target_concurrent_seqs
    step_bytes = weights + kv_per_token_per_gpu * batch * model.max_context * a.avg_context_fraction
    memory_s = step_bytes / (sku.hbm_gbps * 1e9 * a.decode_hbm_efficiency)
    flops_per_gpu = sku.bf16_tflops * 1e12 * a.prefill_mfu
    compute_s = 2.0 * model.params_b * 1e9 * batch / tp / flops_per_gpu
    step_s = max(memory_s, compute_s) + _allreduce_seconds(model, sku, tp, batch, a)
    chunk = a.prefill_chunk_tokens
    prefill_s_per_token = (
        2.0 * model.params_b * 1e9 / (tp * flops_per_gpu) + _allreduce_seconds(model, sku, tp, chunk, a) / chunk
    )
    return SkuFit(
        sku=sku.name,
        tp=tp,
        weights_gib_per_gpu=weights / GIB,
        kv_gib_per_gpu=kv / GIB,
        overhead_gib_per_gpu=overhead / GIB,
        usable_gib_per_gpu=usable / GIB,
        decode_tokens_per_s=batch / step_s,
        prefill_tokens_per_s=1.0 / prefill_s_per_token,
    )


def fit_sku(model: ModelSpec, sku: GpuSku, assumptions: FitAssumptions = DEFAULT_ASSUMPTIONS) -> SkuFit | None:
    """The fit at the smallest allowed TP degree that holds the model, or None when none does."""
    for tp in TP_DEGREES:
        fit = fit_on_sku(model, sku, tp, assumptions)
        if fit is not None:
            return fit
    return None


def fit_model(
    model: ModelSpec,
    skus: Mapping[str, GpuSku] | None = None,
    assumptions: FitAssumptions = DEFAULT_ASSUMPTIONS,
) -> ModelFit:
    """The model's fit on every SKU of the catalog (default: providers.skus.SKUS) it fits on."""
    per_sku: dict[str, SkuFit] = {}
    for name, sku in (SKUS if skus is None else skus).items():
        fit = fit_sku(model, sku, assumptions)
        if fit is not None:
            per_sku[name] = fit
    return ModelFit(model=model, per_sku=per_sku)


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """A disaggregated deployment's pools on one SKU for a prompt/generation mix and a demand."""

    sku: str
    prefill_replicas: int
    decode_replicas: int
    # Prefill replicas per decode replica the mix needs on this SKU, before rounding.
    prefill_per_decode: float
    requests_per_s: float
    prompt_tokens_per_s: float


def prefill_per_decode(fit: SkuFit, prompt_tokens: float, output_tokens: float) -> float:
    """Prefill replicas one decode replica needs on this SKU for the mix (see the module's doc)."""
    if prompt_tokens <= 0 or output_tokens <= 0:
        raise ValueError("a mix needs positive prompt and generated tokens per request")
    return (prompt_tokens / output_tokens) * fit.decode_tokens_per_s / fit.prefill_tokens_per_s


def size_pools(fit: SkuFit, *, prompt_tokens: float, output_tokens: float, demand_tokens_per_s: float) -> PoolSizing:
    """Prefill and decode replicas that serve `demand_tokens_per_s` generated tokens/s of the mix;
    at least one of each (a disaggregated region runs both pools or none)."""
    if demand_tokens_per_s < 0:
        raise ValueError("demand must be >= 0")
    ratio = prefill_per_decode(fit, prompt_tokens, output_tokens)
    requests = demand_tokens_per_s / output_tokens
    prompt_rate = requests * prompt_tokens
    return PoolSizing(
        sku=fit.sku,
        prefill_replicas=max(1, math.ceil(prompt_rate / fit.prefill_tokens_per_s)),
        decode_replicas=max(1, math.ceil(demand_tokens_per_s / fit.decode_tokens_per_s)),
        prefill_per_decode=ratio,
        requests_per_s=requests,
        prompt_tokens_per_s=prompt_rate,
    )
