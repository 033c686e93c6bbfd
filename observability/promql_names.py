"""The metric names a PromQL expression (or a Grafana variable query) reads.

The dashboards and alert rules are checked against the names the components really export
(tests/e2e/test_observability_names.py): a renamed metric must fail a test, not leave an
empty panel or an alert that can never fire. This is a tokenizer, not a PromQL parser: it
knows enough of the grammar to tell a metric name from a function, an aggregation, a
keyword or a label name, which is all the check needs.

- `name{...}` and a bare `name` are metric selectors;
- `name(` is a function or an aggregation, and so is an aggregation before `by`/`without`;
- the parenthesised list after `by`, `without`, `on`, `ignoring`, `group_left` and
  `group_right` holds label names; so does everything inside `{...}` (quoted values are
  skipped with the rest);
- `[...]` (ranges, subqueries, `$__rate_interval`), strings, numbers and durations are skipped;
- Grafana's `label_values(selector, label)` and `query_result(expr)` read their first argument.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Set
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Words that are never metric names where they appear bare.
KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "atan2", "inf", "nan",
})
# Aggregations, which may take their `by (...)` before their argument: `sum by (le) (x)`.
AGGREGATIONS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
})
# Keywords followed by a parenthesised list of label names.
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_TOKEN = re.compile(
    r"""
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<var>\$\{[^}]*\}|\$\w+)
    | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)[a-zA-Z]*)
    | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<open>[({\[])
    | (?P<close>[)}\]])
    | (?P<space>\s+)
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_GRAFANA_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.*),\s*[a-zA-Z_]\w*\s*\)\s*$", re.DOTALL)
_GRAFANA_QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.*)\)\s*$", re.DOTALL)


def _tokens(expr: str) -> Iterator[tuple[str, str]]:
    for m in _TOKEN.finditer(expr):
        kind = m.lastgroup
        assert kind is not None
        if kind != "space":
            yield kind, m.group()


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects (PromQL, or a Grafana label_values/query_result query)."""
    grafana = _GRAFANA_LABEL_VALUES.match(expr)
    if grafana is not None:
        return metric_names(grafana["selector"])
    grafana = _GRAFANA_QUERY_RESULT.match(expr)
    if grafana is not None:
        return metric_names(grafana["expr"])
    tokens = list(_tokens(expr))
    names: set[str] = set()
    # Depth inside {...} and [...], where nothing is a metric name, and the paren depth
    # of a label list (`by (...)`) being skipped, if any.
    braces = brackets = 0
    label_list_depth: int | None = None
    parens = 0
    for i, (kind, text) in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "open":
            if text == "{":
                braces += 1
            elif text == "[":
                brackets += 1
            else:
                parens += 1
            continue
        if kind == "close":
            if text == "}":
                braces -= 1
            elif text == "]":
                brackets -= 1
            else:
                if label_list_depth == parens:
                    label_list_depth = None
                parens -= 1
            continue
        if kind != "ident" or braces or brackets or label_list_depth is not None:
            continue
        if text in LABEL_LIST_KEYWORDS:
            if nxt == ("open", "("):
                label_list_depth = parens + 1
            continue
        if text in KEYWORDS or nxt == ("open", "("):
            continue
        if text in AGGREGATIONS and nxt[1] in ("by", "without"):
            continue
        names.add(text)
    return names


def unknown_names(
    exprs: Mapping[str, Iterable[str]], exported: Set[str], recorded: Set[str] = frozenset(),
) -> dict[str, list[str]]:
    """For each metric name the expressions read that is neither exported nor recorded by a
    rule: where it is read (the keys of `exprs`, e.g. "fabric.json: Request rate")."""
    unknown: dict[str, list[str]] = {}
    for where, queries in exprs.items():
        for query in queries:
            for name in sorted(metric_names(query) - exported - recorded):
                unknown.setdefault(name, []).append(where)
    return unknown


def dashboard_queries(model: Mapping[str, Any], source: str) -> dict[str, list[str]]:
    """The queries of a Grafana dashboard's panels and query variables, by
    "<source>: <panel title>" (or "<source>: $<variable>")."""
    queries: dict[str, list[str]] = {}
    for panel in model.get("panels", []):
        exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        if exprs:
            queries.setdefault(f"{source}: {panel['title']}", []).extend(exprs)
    for variable in model.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            queries[f"{source}: ${variable['name']}"] = [query["query"] if isinstance(query, dict) else query]
    return queries


def rule_queries(rules: Mapping[str, Any], source: str) -> tuple[dict[str, list[str]], set[str]]:
    """The expressions of a Prometheus rules file, by "<source>: <alert or record name>", and
    the names its recording rules define."""
    queries: dict[str, list[str]] = {}
    recorded: set[str] = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]
            queries.setdefault(f"{source}: {name}", []).append(rule["expr"])
            if "record" in rule:
                recorded.add(rule["record"])
    return queries, recorded


# Series Prometheus writes itself for every scrape target (rules may read them: `up`).
SCRAPE_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                           "scrape_samples_post_metric_relabeling", "scrape_series_added"})

# The series names each metric type gives its family (prometheus_client's exposition).
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "info": ("_info",)}
VLLM_METRICS = Path(__file__).parent / "vllm_metrics.txt"


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page (Prometheus text format) can carry: its samples',
    and for families without samples yet, the names their type gives them."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def vllm_relayed_names() -> set[str]:
    """vLLM's names the dashboards read that only a vLLM node (relaying vLLM's page) exports."""
    lines = VLLM_METRICS.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}
