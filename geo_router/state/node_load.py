"""A node's load as its Prometheus /metrics reports it, under vLLM's metric names.

The router scrapes every node about once a second, so `parse_node_metrics` reads only the
few lines it needs instead of building every metric family: a vLLM node's page is mostly
histogram buckets. Any metric may be missing (an older vLLM, a node without LoRA): the
load then says 0, or None for the block size.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

# Running and waiting requests are summed over series (one per engine of a data-parallel
# vLLM, one per model_name); KV usage is the fullest engine's.
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, pre-v0.10 name
_LORA_INFO = "vllm:lora_requests_info"
_CACHE_CONFIG = "vllm:cache_config_info"
_CACHE_HITS = "vllm:prefix_cache_hits_total"
_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
_WANTED = (_RUNNING, _WAITING, *_KV_USAGE, _LORA_INFO, _CACHE_CONFIG, _CACHE_HITS, _CACHE_QUERIES)

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What a node last reported about its load.

    `active_adapters` are the LoRA adapters of its running and waiting requests (vLLM does
    not export which adapters are merely resident); `observed_at` is `time.monotonic()`.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    max_loras: int = 0
    active_adapters: frozenset[str] = frozenset()
    block_size: int | None = None
    # Running totals of prompt tokens found in / looked up in the prefix cache (None: not exported).
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    observed_at: float = 0.0
    # This router's own requests in flight there when the page was read (set by the prober):
    # running + waiting beyond it are other routers' (flow control's view of the node).
    own_in_flight: int = 0


def parse_node_metrics(text: str, *, observed_at: float | None = None) -> NodeLoad:
    """The load in a node's Prometheus text exposition; missing metrics read as idle."""
    running = waiting = 0.0
    kv_usage = 0.0
    max_loras = 0
    block_size: int | None = None
    hits: float | None = None
    queries: float | None = None
    # vLLM keeps one lora_requests_info series per label combination it ever saw; the one
    # with the newest timestamp (its value) is current, per engine.
    lora_latest: dict[str, tuple[float, str, str, str]] = {}
    for line in _lines_starting_with(text, _WANTED):
        name, labels, value = _sample(line)
        if value is None or math.isnan(value):
            continue
        if name == _RUNNING:
            running += value
        elif name == _WAITING:
            waiting += value
        elif name in _KV_USAGE:
            kv_usage = max(kv_usage, value)
        elif name == _LORA_INFO:
            parsed = _labels(labels)
            engine = parsed.get("engine", "")
            if engine not in lora_latest or value >= lora_latest[engine][0]:
                lora_latest[engine] = (
                    value,
                    parsed.get("max_lora", ""),
                    parsed.get("running_lora_adapters", ""),
                    parsed.get("waiting_lora_adapters", ""),
                )
        elif name == _CACHE_CONFIG and block_size is None:
            block_size = _positive_int(_labels(labels).get("block_size"))
        elif name == _CACHE_HITS:
            hits = (hits or 0.0) + value
        elif name == _CACHE_QUERIES:
            queries = (queries or 0.0) + value
    adapters: set[str] = set()
    for _, max_lora, running_loras, waiting_loras in lora_latest.values():
        max_loras = max(max_loras, _positive_int(max_lora) or 0)
        adapters.update(a for a in running_loras.split(",") if a)
        adapters.update(a for a in waiting_loras.split(",") if a)
    return NodeLoad(
        running=max(0, round(running)),
        waiting=max(0, round(waiting)),
        kv_usage=min(1.0, max(0.0, kv_usage)),
        max_loras=max_loras,
        active_adapters=frozenset(adapters),
        block_size=block_size,
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        observed_at=time.monotonic() if observed_at is None else observed_at,
    )


def _lines_starting_with(text: str, prefixes: tuple[str, ...]) -> list[str]:
    """The lines of `text` that start with one of `prefixes`, found without splitting it all."""
    # str.find runs in C: a few scans of the page beat a Python loop over its lines.
    lines: list[str] = []
    for prefix in prefixes:
        start = 0 if text.startswith(prefix) else text.find("\n" + prefix)
        while start >= 0:
            if text[start] == "\n":
                start += 1
            end = text.find("\n", start)
            lines.append(text[start:] if end < 0 else text[start:end])
            start = -1 if end < 0 else text.find("\n" + prefix, end)
    return lines


def _sample(line: str) -> tuple[str, str, float | None]:
    """(name, raw label text, value) of one sample line; value None when unreadable."""
    brace = line.find("{")
    if brace >= 0:
        # Label values may hold anything but the value and timestamp after them hold no '}'.
        close = line.rfind("}")
        if close < brace:
            return "", "", None
        name, labels, rest = line[:brace].rstrip(), line[brace + 1 : close], line[close + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = ""
    parts = rest.split()
    if not parts:
        return name, labels, None
    try:
        return name, labels, float(parts[0])
    except ValueError:
        return name, labels, None


def _labels(raw: str) -> dict[str, str]:
    return {m.group(1): _unescape(m.group(2)) for m in _LABEL.finditer(raw)}


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _positive_int(raw: str | None) -> int | None:
    try:
        n = int(raw) if raw is not None else 0
    except ValueError:
        return None
    return n if n > 0 else None
