"""Read vLLM's Prometheus /metrics into EngineStats, across vLLM restarts.

Names are vLLM's V1 metrics, with the older spellings vLLM used before
(`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*`) accepted as well. Series are
summed over vLLM's `engine` label (data-parallel engines). Counters restart from zero
with a new vLLM process; the node's totals must not go backwards, so each process's
last values are folded into a base when it is replaced.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_string_to_metric_families

from data_plane.engine.base import EngineStats

_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_COUNTERS = {
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:num_preemptions_total": "num_preemptions_total",
}
_SUCCESS = "vllm:request_success_total"
_LORA_INFO = "vllm:lora_requests_info"


@dataclass(frozen=True, slots=True)
class VllmCounters:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_aborted_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_preemptions_total: int = 0

    def __add__(self, other: VllmCounters) -> VllmCounters:
        return VllmCounters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """One scrape of a vLLM process."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    counters: VllmCounters = field(default_factory=VllmCounters)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0


def _adapters(label: str) -> tuple[str, ...]:
    return tuple(sorted({a.strip() for a in label.split(",") if a.strip()}))


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse a vLLM /metrics exposition (raises ValueError if it is not one)."""
    gauges: dict[str, float] = {}
    kv_usage: dict[str, float] = {}
    counters: dict[str, float] = {}
    finished = aborted = 0.0
    lora_ts = -1.0
    lora_labels: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if name in _GAUGES:
                gauges[_GAUGES[name]] = gauges.get(_GAUGES[name], 0.0) + value
            elif name in _KV_USAGE:
                # Several engines share nothing: report the fullest.
                kv_usage[name] = max(kv_usage.get(name, 0.0), value)
            elif name in _COUNTERS:
                counters[_COUNTERS[name]] = counters.get(_COUNTERS[name], 0.0) + value
            elif name == _SUCCESS:
                finished += value
                if sample.labels.get("finished_reason") == "abort":
                    aborted += value
            elif name == _LORA_INFO and value >= lora_ts:
                # One series per label set ever seen; the value is its update time.
                lora_ts, lora_labels = value, sample.labels
    usage = next((kv_usage[n] for n in _KV_USAGE if n in kv_usage), 0.0)
    try:
        max_loras = int(lora_labels.get("max_lora", "0") or 0)
    except ValueError:
        max_loras = 0
    return VllmMetrics(
        running=int(gauges.get("running", 0)),
        waiting=int(gauges.get("waiting", 0)),
        kv_cache_usage=min(1.0, max(0.0, usage)),
        counters=VllmCounters(
            requests_finished_total=int(finished),
            requests_aborted_total=int(aborted),
            **{k: int(v) for k, v in counters.items()},
        ),
        running_loras=_adapters(lora_labels.get("running_lora_adapters", "")),
        waiting_loras=_adapters(lora_labels.get("waiting_lora_adapters", "")),
        max_loras=max_loras,
    )


class StatsTracker:
    """EngineStats from successive scrapes of successive vLLM processes."""

    def __init__(self, max_loras: int = 0) -> None:
        self._base = VllmCounters()
        self._current = VllmCounters()
        self._generation = 0
        self._max_loras = max_loras
        self._latest = VllmMetrics()
        self._live = False
        # vLLM does not export which adapters occupy its GPU slots. It evicts the least
        # recently used, so the last `max_loras` adapters seen running approximate them.
        self._resident: dict[str, None] = {}

    def update(self, generation: int, metrics: VllmMetrics) -> None:
        """Record a scrape of the process `generation` (the supervisor's counter)."""
        if generation != self._generation:
            self._base = self._base + self._current
            self._current = VllmCounters()
            self._generation = generation
        self._current = metrics.counters
        self._latest = metrics
        self._live = True
        for name in metrics.running_loras:
            self._resident.pop(name, None)
            self._resident[name] = None
        slots = metrics.max_loras or self._max_loras
        while slots and len(self._resident) > slots:
            del self._resident[next(iter(self._resident))]

    def child_exited(self) -> None:
        """Nothing runs, waits or stays loaded in a process that is gone."""
        self._live = False
        self._resident.clear()

    def stats(self) -> EngineStats:
        c = self._base + self._current
        m = self._latest if self._live else VllmMetrics()
        return EngineStats(
            running=m.running,
            waiting=m.waiting,
            kv_cache_usage=m.kv_cache_usage,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            requests_finished_total=c.requests_finished_total,
            requests_aborted_total=c.requests_aborted_total,
            prefix_cache_queries_total=c.prefix_cache_queries_total,
            prefix_cache_hits_total=c.prefix_cache_hits_total,
            num_preemptions_total=c.num_preemptions_total,
            running_loras=m.running_loras,
            waiting_loras=m.waiting_loras,
            loaded_loras=tuple(self._resident),
            max_loras=m.max_loras or self._max_loras,
        )


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)")
_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum", "_info")


def drop_metric_families(text: str, families: Collection[str]) -> str:
    """`text` without the HELP/TYPE lines and samples of the named metric families.

    A family is named as in its TYPE line (`vllm:prompt_tokens` covers
    `vllm:prompt_tokens_total`, `vllm:e2e_request_latency_seconds` its buckets).
    """
    if not families:
        return text
    drop = set(families)

    def dropped(name: str) -> bool:
        if name in drop:
            return True
        return any(name.endswith(sfx) and name[: -len(sfx)] in drop for sfx in _SUFFIXES)

    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            # Prometheus' text format names a counter's HELP/TYPE lines with `_total`.
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and dropped(parts[2]):
                continue
        else:
            match = _SAMPLE.match(line)
            if match and dropped(match.group(1)):
                continue
        kept.append(line)
    return "\n".join(kept) + ("\n" if kept else "")
