"""The Grafana dashboards in observability/grafana: the committed JSON is what
build_dashboards.py writes, each is a self-contained Grafana model (built-in panels only,
the Prometheus datasource as a variable, a layout without overlaps), and every query is
valid PromQL (promtool parses them as recording rules). That they read only metrics the
components export is checked against running components in tests/e2e/test_observability_names.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import build_dashboards
import pytest
import yaml
from promql_names import dashboard_queries

GRAFANA_DIR = Path(__file__).parents[3] / "observability" / "grafana"
BUILTIN_PANELS = {"row", "timeseries", "stat"}
VARIABLES = {"fabric": set(), "region": {"region"}, "node": {"node"}, "tenant": {"tenant"}}


def _dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(GRAFANA_DIR.glob("*.json"))}


def test_the_committed_json_is_what_the_script_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_dashboards.main(["--check"]) == 0
    assert sorted(build_dashboards.rendered()) == sorted(p.name for p in GRAFANA_DIR.glob("*.json"))
    # A hand edit is caught.
    for name, text in build_dashboards.rendered().items():
        (tmp_path / name).write_text(text.replace('"30s"', '"1m"'))
    monkeypatch.setattr(build_dashboards, "OUT_DIR", tmp_path)
    assert build_dashboards.main(["--check"]) == 1
    assert build_dashboards.main([]) == 0 and build_dashboards.main(["--check"]) == 0


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_each_dashboard_is_a_self_contained_grafana_model(name: str) -> None:
    model = _dashboards()[name]
    assert model["schemaVersion"] == 39 and model["uid"] == f"meridian-{name}"
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert set(variables) - {"datasource"} == VARIABLES[name]
    panels = model["panels"]
    assert len(panels) >= 8
    assert {p["type"] for p in panels} <= BUILTIN_PANELS
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        for target in p.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    text = json.dumps(panels)
    for variable in VARIABLES[name]:
        assert f"${variable}" in text, f"${variable} is never used"


def _as_promql(expr: str) -> str:
    """A Grafana query with its variables replaced by values PromQL accepts."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
    return re.sub(r"\$\{?(\w+)\}?", "x", expr)


def test_every_dashboard_query_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    rules = []
    for name, model in _dashboards().items():
        for where, exprs in dashboard_queries(model, name).items():
            if "$" in where.split(": ", 1)[1][:1]:
                continue  # a Grafana variable query (label_values), not PromQL
            rules += [{"record": f"dashboard:query:{len(rules) + i}", "expr": _as_promql(e)} for i, e in enumerate(exprs)]
    assert len(rules) >= 60
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # And promtool would say so for a broken one.
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(a[5m])"}]}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
