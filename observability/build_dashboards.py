"""Writes Meridian's Grafana dashboards (observability/grafana/*.json) from the panels below.

    python observability/build_dashboards.py           # rewrite the JSON files
    python observability/build_dashboards.py --check   # exit 1 if they differ from this script

The JSON is committed so that an operator imports it without running anything; it is
generated because four dashboards of some forty panels share one layout, one datasource
variable and one query style, which hand-written JSON would let drift. The output is
deterministic (sorted keys, ids and positions from the panel order), so the files change
only when this script does (tests/unit/observability/test_dashboards.py checks both).

Every dashboard takes its Prometheus datasource as the `datasource` variable and uses only
Grafana's built-in panels. Node panels select by the `region` and `node` target labels the
scrape configuration puts on node targets (observability/prometheus/prometheus.yml): a
node's own /metrics carries only vLLM's `model_name` label.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboard_panels import DASHBOARDS, Dashboard, Panel, Row

OUT_DIR = Path(__file__).parent / "grafana"
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


@dataclass
class _Layout:
    """Places panels left to right, wrapping at the grid's width; rows span it."""

    x: int = 0
    y: int = 0
    row_height: int = 0
    next_id: int = 1
    placed: list[dict[str, Any]] = field(default_factory=list)

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, row: Row) -> None:
        self._newline()
        self.placed.append({
            "type": "row", "title": row.title, "id": self._id(), "collapsed": False, "panels": [],
            "gridPos": {"x": 0, "y": self.y, "w": GRID_WIDTH, "h": 1},
        })
        self.y += 1

    def panel(self, panel: Panel) -> None:
        if self.x + panel.width > GRID_WIDTH:
            self._newline()
        self.placed.append(_panel_json(panel, self._id(), {"x": self.x, "y": self.y, "w": panel.width, "h": panel.height}))
        self.x += panel.width
        self.row_height = max(self.row_height, panel.height)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
        self.x, self.row_height = 0, 0


def _panel_json(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    targets = [
        {"datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend, "refId": chr(ord("A") + i),
         "range": True, "instant": False}
        for i, q in enumerate(panel.queries)
    ]
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "bars" if panel.bars else "line", "fillOpacity": 10,
                              "lineWidth": 1, "showPoints": "never", "spanNulls": False}
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.min is not None:
        defaults["min"] = panel.min
    options: dict[str, Any] = {"tooltip": {"mode": "multi", "sort": "desc"},
                               "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
    if panel.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "none", "textMode": "auto"}
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": grid, "targets": targets, "options": options,
        "fieldConfig": {"defaults": defaults, "overrides": []},
    }


def _variables(dashboard: Dashboard) -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = [{
        "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
        "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": [],
    }]
    for v in dashboard.variables:
        variables.append({
            "name": v.name, "label": v.label, "type": "query", "datasource": DATASOURCE,
            "definition": v.query, "query": {"query": v.query, "refId": f"{v.name}-variable"},
            "refresh": 2, "sort": 1, "multi": False, "includeAll": False, "current": {},
            "hide": 0, "regex": "", "options": [],
        })
    return variables


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    """The Grafana JSON model of `dashboard`."""
    layout = _Layout()
    for item in dashboard.items:
        if isinstance(item, Row):
            layout.row(item)
        else:
            layout.panel(item)
    return {
        "uid": dashboard.uid, "title": dashboard.title, "description": dashboard.description,
        "tags": ["meridian", *dashboard.tags], "schemaVersion": SCHEMA_VERSION, "version": 1,
        "editable": True, "graphTooltip": 1, "refresh": "30s", "timezone": "browser",
        "time": {"from": "now-3h", "to": "now"}, "timepicker": {},
        "templating": {"list": _variables(dashboard)},
        "annotations": {"list": []}, "links": [
            {"title": "Meridian", "type": "dashboards", "tags": ["meridian"], "asDropdown": True,
             "includeVars": False, "keepTime": True},
        ],
        "panels": layout.placed,
    }


def render(dashboard: Dashboard) -> str:
    return json.dumps(dashboard_json(dashboard), indent=2, sort_keys=True) + "\n"


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{d.uid.removeprefix('meridian-')}.json": render(d) for d in DASHBOARDS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ")
    args = parser.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)} (run python observability/build_dashboards.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
