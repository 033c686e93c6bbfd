"""Model fit against hand calculations (see the formulas in control_plane/placement/fit.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from control_plane.placement.fit import (
    GIB,
    ModelSpec,
    SkuFit,
    fit_model,
    fit_on_sku,
    fit_sku,
    prefill_per_decode,
    size_pools,
    tp_degree_allowed,
)
from control_plane.placement.models import LLAMA_3_8B, known_models
from providers.offerings import Offering
from providers.skus import SKUS

# A 70B bf16 model with a small KV budget: 2 sequences of 8192 tokens.
M70 = ModelSpec("m70", params_b=70.0, layers=80, kv_heads=8, head_dim=128, max_context=8192,
                target_concurrent_seqs=2, attention_heads=64)
H100 = SKUS["H100-80GB-SXM"]


def test_weight_and_kv_bytes_by_hand() -> None:
    assert M70.weight_bytes == 140e9  # 70e9 params × 2 bytes
    # 2 (K,V) × 80 layers × 8 heads × 128 dims × 2 bytes = 327,680 bytes per token
    assert M70.kv_bytes_per_token == 327_680
    assert M70.kv_bytes == 327_680 * 8192 * 2
    int4 = ModelSpec("q", 70.0, 80, 8, 128, quantization="awq")
    assert int4.weight_bytes == pytest.approx(70e9 * 0.5625)
    fp8_kv = ModelSpec("k", 70.0, 80, 8, 128, kv_cache_dtype="fp8")
    assert fp8_kv.kv_bytes_per_token == 163_840


def test_70b_bf16_needs_tp2_on_h100() -> None:
    # TP1: 130.39 GiB of weights alone exceed 0.9 × 80 = 72 GiB.
    assert fit_on_sku(M70, H100, 1) is None
    fit = fit_sku(M70, H100)
    assert fit is not None and fit.tp == 2
    weights = 140e9 / 2 / GIB  # 65.19 GiB per GPU
    kv = 2 * 80 * 4 * 128 * 2 * 8192 * 2 / GIB  # 4 KV heads per GPU: 2.5 GiB
    overhead = 0.02 * (weights + kv) + 1.5
    assert fit.weights_gib_per_gpu == pytest.approx(weights)
    assert fit.kv_gib_per_gpu == pytest.approx(2.5)
    assert fit.overhead_gib_per_gpu == pytest.approx(overhead)
    assert fit.used_gib_per_gpu == pytest.approx(70.546, abs=1e-3)
    assert fit.usable_gib_per_gpu == pytest.approx(72.0)


def test_70b_does_not_fit_one_l4_and_needs_all_eight() -> None:
    l4 = SKUS["L4-24GB"]
    for tp in (1, 2, 4):
        assert fit_on_sku(M70, l4, tp) is None  # 130.39 / 4 = 32.6 GiB > 0.9 × 22.4 GiB
    fit = fit_sku(M70, l4)
    assert fit is not None and fit.tp == 8
    # 8 GPUs for 8 KV heads: one head per GPU.
    assert fit.kv_gib_per_gpu == pytest.approx(2 * 80 * 1 * 128 * 2 * 16384 / GIB)
    assert fit_sku(M70, SKUS["T4-16GB"]) is None  # 16.3 GiB of weights per GPU even at TP8 > 14.4


def test_decode_and_prefill_roofline_by_hand() -> None:
    fit = fit_sku(M70, H100)
    assert fit is not None
    hidden = round((70e9 / (12 * 80)) ** 0.5)  # 8539
    assert M70.hidden == hidden
    # Decode step: weights per GPU + KV of 2 sequences at half of 8192 tokens, at 60 % of 3350 GB/s,
    # plus 160 all-reduces of 2 × 8539 × 2 bytes over NVLink (10 µs + bytes / 900 GB/s).
    step_bytes = 70e9 + 163_840 * 2 * 8192 * 0.5
    allreduce = 160 * (10e-6 + (2 * hidden * 2) * 2 * (1 / 2) / 900e9)
    step = step_bytes / (3350e9 * 0.6) + allreduce
    assert fit.decode_tokens_per_s == pytest.approx(2 / step, rel=1e-9)
    assert fit.decode_tokens_per_s == pytest.approx(53.91, abs=0.01)
    # Prefill: 2 × params FLOPs per token at 50 % of 2 × 989 TFLOP/s, plus a 2048-token chunk's
    # all-reduces spread over its tokens.
    chunk_allreduce = 160 * (10e-6 + (2048 * hidden * 2) * 2 * (1 / 2) / 900e9)
    per_token = 2 * 70e9 / (2 * 989e12 * 0.5) + chunk_allreduce / 2048
    assert fit.prefill_tokens_per_s == pytest.approx(1 / per_token, rel=1e-9)


def test_pcie_parts_pay_for_tensor_parallelism() -> None:
    sxm, pcie = fit_on_sku(M70, H100, 8), fit_on_sku(M70, SKUS["H100-80GB-PCIe"], 8)
    assert sxm is not None and pcie is not None
    # Beyond the bandwidth and FLOP/s ratios: the all-reduces over PCIe cost extra.
    assert pcie.decode_tokens_per_s / sxm.decode_tokens_per_s < 2000 / 3350
    assert pcie.prefill_tokens_per_s / sxm.prefill_tokens_per_s < 756 / 989
    single = fit_on_sku(LLAMA_3_8B, SKUS["H100-80GB-PCIe"], 1)
    single_sxm = fit_on_sku(LLAMA_3_8B, H100, 1)
    assert single is not None and single_sxm is not None
    # At TP1 there is no interconnect traffic: only HBM bandwidth differs.
    assert single.decode_tokens_per_s / single_sxm.decode_tokens_per_s == pytest.approx(2000 / 3350)


def test_tp_rule() -> None:
    assert [tp for tp in (1, 2, 4, 8, 16) if tp_degree_allowed(M70, tp)] == [1, 2, 4, 8]
    odd = ModelSpec("odd", 30.0, 48, kv_heads=6, head_dim=128, attention_heads=48)
    # 4 neither divides 6 KV heads nor is a multiple of them; 2 divides; 3 is not a power of two.
    assert [tp for tp in (1, 2, 3, 4, 8) if tp_degree_allowed(odd, tp)] == [1, 2]
    mqa = ModelSpec("mqa", 30.0, 48, kv_heads=1, head_dim=128)
    assert all(tp_degree_allowed(mqa, tp) for tp in (1, 2, 4, 8))  # one KV head replicated


def test_cost_per_million_tokens() -> None:
    fit = fit_model(M70, {"H100-80GB-SXM": H100})
    p5 = Offering("aws", "aws:us-east-1", "p5.48xlarge", "H100-80GB-SXM", 8, 192, 2048, 98.32, 30.0)
    assert fit.replicas_per_instance(p5) == 4
    per_hour = 4 * fit.per_sku["H100-80GB-SXM"].decode_tokens_per_s * 3600
    assert fit.cost_per_million_tokens(p5) == pytest.approx(98.32 / per_hour * 1e6)
    assert fit.cost_per_million_tokens(p5) == pytest.approx(126.6, abs=0.1)
    assert fit.cost_per_million_tokens(p5, spot=True) == pytest.approx(30.0 / per_hour * 1e6)
    one = Offering("aws", "aws:us-east-1", "x.1", "H100-80GB-SXM", 1, 8, 64, 5.0, None)
    assert fit.replicas_per_instance(one) == 0 and fit.cost_per_million_tokens(one) is None
    assert fit.cost_per_million_tokens(replace(p5, price_per_hour=None)) is None
    l4 = Offering("aws", "aws:us-east-1", "g6.xlarge", "L4-24GB", 1, 4, 16, 0.8, None)
    assert fit.cost_per_million_tokens(l4) is None  # not in the fit at all


def test_presets_fit_where_expected() -> None:
    models = known_models()
    eight = fit_model(models["llama-3-8b"])
    assert eight.per_sku["H100-80GB-SXM"].tp == 1
    seventy = fit_model(models["llama-3-70b"])  # 16 × 8192 tokens of KV: 40 GiB
    assert seventy.per_sku["H100-80GB-SXM"].tp == 4
    assert "L4-24GB" not in seventy.per_sku and "T4-16GB" not in seventy.per_sku


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="quantization"):
        ModelSpec("x", 7.0, 32, 8, 128, quantization="int3")
    with pytest.raises(ValueError, match="positive"):
        ModelSpec("x", 0.0, 32, 8, 128)


# --- prefill/decode pools --------------------------------------------------------------


def _llama8b(sku: str) -> SkuFit:
    fit = fit_sku(LLAMA_3_8B, SKUS[sku])
    assert fit is not None
    return fit


def test_pools_serve_the_mix_by_the_roofline() -> None:
    fit = _llama8b("H100-80GB-SXM")
    # 20,000 generated tokens/s of 4,000-token prompts and 200-token answers: 100 requests/s,
    # 400,000 prompt tokens/s for the prefill pool.
    pools = size_pools(fit, prompt_tokens=4000, output_tokens=200, demand_tokens_per_s=20_000)
    assert pools.requests_per_s == pytest.approx(100.0)
    assert pools.prompt_tokens_per_s == pytest.approx(400_000.0)
    assert pools.prefill_replicas == math.ceil(400_000 / fit.prefill_tokens_per_s)
    assert pools.decode_replicas == math.ceil(20_000 / fit.decode_tokens_per_s)
    # Each pool carries its share: a replica fewer would not.
    assert (pools.prefill_replicas - 1) * fit.prefill_tokens_per_s < 400_000 <= pools.prefill_replicas * (
        fit.prefill_tokens_per_s)
    assert pools.prefill_per_decode == pytest.approx(20 * fit.decode_tokens_per_s / fit.prefill_tokens_per_s)


def test_a_disaggregated_region_runs_both_pools_even_without_demand() -> None:
    pools = size_pools(_llama8b("L4-24GB"), prompt_tokens=1024, output_tokens=256, demand_tokens_per_s=0)
    assert (pools.prefill_replicas, pools.decode_replicas) == (1, 1)


def test_prompt_heavy_mixes_want_more_prefill() -> None:
    fit = _llama8b("H100-80GB-SXM")
    chat = prefill_per_decode(fit, 1000, 500)
    rag = prefill_per_decode(fit, 8000, 200)
    assert rag == pytest.approx(chat * 20)
    assert chat < 1 < rag


def test_skus_rich_in_bandwidth_but_not_flops_want_more_prefill_per_decode() -> None:
    mix = (2048, 256)
    h100 = prefill_per_decode(_llama8b("H100-80GB-SXM"), *mix)
    # H200: H100's FLOP/s, 43% more HBM bandwidth: decode speeds up, prefill does not.
    assert prefill_per_decode(_llama8b("H200-141GB"), *mix) > 1.3 * h100
    # A100: a third of the FLOP/s for 60% of the bandwidth: prefill is the bottleneck.
    assert prefill_per_decode(_llama8b("A100-80GB"), *mix) > 1.5 * h100
    # L4: little bandwidth for its FLOP/s: decode is, so fewer prefill workers per decode worker.
    assert prefill_per_decode(_llama8b("L4-24GB"), *mix) < h100


def test_a_mix_without_tokens_or_a_negative_demand_is_refused() -> None:
    fit = _llama8b("H100-80GB-SXM")
    with pytest.raises(ValueError):
        prefill_per_decode(fit, 0, 100)
    with pytest.raises(ValueError):
        size_pools(fit, prompt_tokens=10, output_tokens=10, demand_tokens_per_s=-1)
