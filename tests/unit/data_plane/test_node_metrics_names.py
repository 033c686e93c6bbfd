"""The node's /metrics under vLLM's names and labels, as a scraper written for vLLM
(Gateway API inference extension, llm-d, KEDA) reads them."""

from __future__ import annotations

import time

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from data_plane.engine.base import EngineStats
from data_plane.server.metrics import NodeMetrics

MODEL = "tiny-llama"


def scrape(metrics: NodeMetrics) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def only_sample(families: dict[str, Metric], name: str, sample: str | None = None) -> tuple[dict[str, str], float]:
    family = families[name]
    samples = [s for s in family.samples if s.name == (sample or name)]
    assert len(samples) == 1, samples
    return samples[0].labels, samples[0].value


def test_lora_requests_info_lists_adapters_like_vllm() -> None:
    stats = EngineStats(
        running=3, waiting=2, running_loras=("sql", "chat", "sql"), waiting_loras=("summarise",),
        loaded_loras=("sql", "chat", "summarise"), max_loras=4,
    )
    before = time.time()
    families = scrape(NodeMetrics(MODEL, lambda: stats))
    after = time.time()

    assert families["vllm:lora_requests_info"].type == "gauge"
    labels, value = only_sample(families, "vllm:lora_requests_info")
    assert labels == {"max_lora": "4", "running_lora_adapters": "sql,chat", "waiting_lora_adapters": "summarise"}
    # vLLM sets the gauge to the time the adapters were observed; consumers keep the newest.
    assert before <= value <= after


def test_lora_requests_info_with_no_adapter_requests_and_without_lora() -> None:
    families = scrape(NodeMetrics(MODEL, lambda: EngineStats(max_loras=2)))
    labels, _ = only_sample(families, "vllm:lora_requests_info")
    assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    # An engine without LoRA support reports max_loras=0 and, like vLLM, no LoRA metric.
    assert "vllm:lora_requests_info" not in scrape(NodeMetrics(MODEL, lambda: EngineStats()))


def test_engine_counters_and_gauges_have_vllm_names() -> None:
    stats = EngineStats(
        running=5, waiting=7, kv_cache_usage=0.25, prompt_tokens_total=120, generation_tokens_total=40,
        prefix_cache_queries_total=96, prefix_cache_hits_total=64, num_preemptions_total=3,
    )
    families = scrape(NodeMetrics(MODEL, lambda: stats))

    expected = {
        ("vllm:num_requests_running", "gauge", "vllm:num_requests_running"): 5,
        ("vllm:num_requests_waiting", "gauge", "vllm:num_requests_waiting"): 7,
        ("vllm:kv_cache_usage_perc", "gauge", "vllm:kv_cache_usage_perc"): 0.25,
        ("vllm:prompt_tokens", "counter", "vllm:prompt_tokens_total"): 120,
        ("vllm:generation_tokens", "counter", "vllm:generation_tokens_total"): 40,
        # Both count tokens (vLLM v1), so hits / queries is the token hit rate.
        ("vllm:prefix_cache_queries", "counter", "vllm:prefix_cache_queries_total"): 96,
        ("vllm:prefix_cache_hits", "counter", "vllm:prefix_cache_hits_total"): 64,
        ("vllm:num_preemptions", "counter", "vllm:num_preemptions_total"): 3,
    }
    for (family, kind, sample), value in expected.items():
        assert families[family].type == kind, family
        assert only_sample(families, family, sample) == ({"model_name": MODEL}, value)


def test_cache_config_info_when_given() -> None:
    metrics = NodeMetrics(
        MODEL, EngineStats, cache_config={"block_size": "16", "enable_prefix_caching": "True"}
    )
    labels, value = only_sample(scrape(metrics), "vllm:cache_config_info")
    assert labels == {"block_size": "16", "enable_prefix_caching": "True", "engine": "0"}
    assert value == 1
    assert "vllm:cache_config_info" not in scrape(NodeMetrics(MODEL, EngineStats))


def test_request_metrics_keep_their_vllm_names() -> None:
    metrics = NodeMetrics(MODEL, EngineStats)
    metrics.time_to_first_token.observe(0.05)
    metrics.request_finished("stop")
    families = scrape(metrics)
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert only_sample(families, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == (
        {"model_name": MODEL}, 1
    )
    assert only_sample(families, "vllm:request_success", "vllm:request_success_total") == (
        {"model_name": MODEL, "finished_reason": "stop"}, 1
    )
