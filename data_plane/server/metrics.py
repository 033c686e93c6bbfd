"""The node's Prometheus metrics, under vLLM's names so that dashboards, autoscalers and
the router treat a torch-engine node and a vLLM node alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from data_plane.engine.base import EngineStats
from meridian.contracts import ColdStart

# vLLM's bucket boundaries, so histograms from both engines can be aggregated.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Reads the engine's own gauges and counters at scrape time."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        cache_config: Mapping[str, str] | None = None,
        *,
        prompt_sources: bool = True,
    ) -> None:
        self._model = model_name
        self._stats = stats
        self._cache_config = dict(cache_config) if cache_config is not None else None
        # An engine that exports these itself (vLLM, relayed) must not have them shadowed.
        self._prompt_sources = prompt_sources

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        labels = ["model_name"]
        values = [self._model]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests being decoded.", s.running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 1 means full.", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens_total),
            ("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries_total),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits_total),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.num_preemptions_total),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c
        if self._prompt_sources:
            yield from _prompt_sources(s, self._model)
        if s.max_loras > 0:
            yield _lora_info(s)
        if self._cache_config is not None:
            # vLLM emulates an Info metric with a gauge fixed at 1 (multiprocess-safe).
            info = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                labels=[*self._cache_config, "engine"],
            )
            info.add_metric([*self._cache_config.values(), "0"], 1.0)
            yield info


class _ColdStartCollector(Collector):
    def __init__(self, timeline: Callable[[], ColdStart]) -> None:
        self._timeline = timeline

    def collect(self) -> Iterator[Metric]:
        t = self._timeline()
        g = GaugeMetricFamily(
            "meridian_node_cold_start_seconds",
            "Seconds from agent start until the step (weights_cached, loaded, ready) was reached.",
            labels=["step"],
        )
        for step, value in (("weights_cached", t.weights_cached_s), ("loaded", t.loaded_s), ("ready", t.ready_s)):
            if value is not None:
                g.add_metric([step], value)
        yield g
        fetched = CounterMetricFamily(
            "meridian_node_weights_fetched_bytes", "Weight bytes this node fetched at start, by source.",
            labels=["source"],
        )
        fetched.add_metric([t.weights_source or "none"], t.fetched_bytes)
        yield fetched


def _prompt_sources(s: EngineStats, model: str) -> Iterator[Metric]:
    """vLLM's prompt tokens by where their KV came from, and the cached ones (local prefix
    cache + another node's transfer), as vllm/v1/metrics/loggers.py exports them."""
    by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                    labels=["model_name", "source"])
    for source, value in (("local_compute", s.prompt_tokens_local_compute_total),
                          ("local_cache_hit", s.prompt_tokens_local_cache_hit_total),
                          ("external_kv_transfer", s.prompt_tokens_external_kv_transfer_total)):
        by_source.add_metric([model, source], value)
    yield by_source
    cached = CounterMetricFamily("vllm:prompt_tokens_cached",
                                 "Number of cached prompt tokens (local + external).", labels=["model_name"])
    cached.add_metric([model], s.prompt_tokens_local_cache_hit_total + s.prompt_tokens_external_kv_transfer_total)
    yield cached


def _lora_info(s: EngineStats) -> Metric:
    """vLLM's `vllm:lora_requests_info`: the adapters of running and waiting requests as
    comma-joined label values, the gauge's value being when they were observed.

    vLLM keeps one series per label combination ever seen and consumers (the Gateway API
    inference extension, llm-d) read the one with the newest timestamp; this reads the
    engine at scrape time, so the single series it exports is always that one.
    """
    g = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    g.add_metric(
        [str(s.max_loras), _join_unique(s.waiting_loras), _join_unique(s.running_loras)],
        time.time(),
    )
    return g


def _join_unique(names: tuple[str, ...]) -> str:
    # vLLM joins the keys of a per-adapter dict: each name once, first-seen order.
    return ",".join(dict.fromkeys(names))


class NodeMetrics:
    """A per-app registry with the request-level metrics the server records.

    `cache_config` (label name -> value), when given, is exported as vLLM's
    `vllm:cache_config_info` (e.g. block_size, enable_prefix_caching).
    """

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        cache_config: Mapping[str, str] | None = None,
        *,
        request_metrics: bool = True,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        # Without request_metrics (an engine that measures its own requests, whose families
        # the node relays), these are kept out of the registry and never exported.
        registry = self.registry if request_metrics else CollectorRegistry()
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=TTFT_BUCKETS, registry=registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Time between two generated tokens.", labels,
            buckets=ITL_BUCKETS, registry=registry,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency from arrival to last token.",
            labels, buckets=E2E_BUCKETS, registry=registry,
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=registry,
        )
        self.registry.register(_EngineCollector(model_name, stats, cache_config,
                                                prompt_sources=request_metrics))
        # A decode node's pulls of prefilled KV from its peers, by outcome (data_plane.server.kv_pull).
        self._kv_pulls = Counter(
            "meridian_node_kv_pulls", "Prefilled KV pulls from prefill nodes, by outcome.",
            ["outcome"], registry=self.registry,
        )
        # The e2e histogram's count and sum, kept here too for the heartbeats (NodeLoad).
        self._measures_requests = request_metrics
        self._completed = 0
        self._latency_s_sum = 0.0

    def track_cold_start(self, timeline: Callable[[], ColdStart]) -> None:
        """Export the node's cold-start timeline (seconds from agent start to each step)."""
        self.registry.register(_ColdStartCollector(timeline))

    def kv_pulled(self, outcome: str) -> None:
        self._kv_pulls.labels(outcome).inc()

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def request_completed(self, latency_s: float) -> None:
        """A request answered in full after `latency_s` from its arrival."""
        self.e2e_latency.observe(latency_s)
        self._completed += 1
        self._latency_s_sum += latency_s

    def request_totals(self) -> tuple[int, float] | None:
        """(requests completed, sum of their latencies in seconds) since start; None when
        the engine measures its requests itself (vLLM) and this registry does not."""
        return (self._completed, self._latency_s_sum) if self._measures_requests else None

    def family_names(self) -> set[str]:
        """Names of the metric families this registry exports."""
        return {family.name for family in self.registry.collect()}

    def render(self) -> bytes:
        return generate_latest(self.registry)
