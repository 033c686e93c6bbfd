// The fleet loops' side: placement plans (where the plan in force stands, the latest preview and
// its diff), autoscaler decisions, the event feed and chaos drill reports. Write controls
// (preview, apply) are built only for keys with the operator or admin scope; a read-only key gets
// the same panels without them. A plan is called "In force" only when the reconciler says every
// node group holds its target; Apply is offered only for the newest plan, when it is a preview
// solved against the plan in force (the API refuses any other with 409 too).

import { ApiError, get, post } from "./api.js";
import { fmtMoney, fmtTime, h, replace, s, short } from "./dom.js";

export function canOperate(viewer) {
  return viewer.scopes.includes("admin") || viewer.scopes.includes("operator");
}

async function currentPlan(key) {
  try {
    return await get(key, "/v1/placement/current");
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) return null;
    throw e;
  }
}

const STATE_LABELS = { in_force: "In force", reconciling: "Reconciling", failing: "Failing", no_plan: "No plan applied yet" };

function stateLabel(progress) {
  const label = STATE_LABELS[progress.state] || progress.state;
  return progress.state === "failing" ? `${label}: ${progress.summary}` : label;
}

// The node groups of the plan in force: what each should hold against what its provider holds.
function groupsTable(groups) {
  if (!groups.length) return h("p", { class: "muted" }, "No node groups.");
  return h("table", {},
    h("thead", {}, h("tr", {}, ["Deployment", "Region", "Instance", "Desired", "Actual", "Ready", "State", "Last error"]
      .map((c) => h("th", {}, c)))),
    h("tbody", {}, groups.map((g) => h("tr", {
      "data-group": `${g.model}@${g.region}/${g.instance_type}`, "data-desired": g.desired, "data-actual": g.actual,
      class: g.last_error ? "group-failing" : g.actual !== g.desired ? "group-moving" : "" },
    h("td", {}, g.role === "both" ? g.model : `${g.model} (${g.role})`), h("td", {}, h("code", {}, g.region)),
    h("td", {}, `${g.instance_type}${g.spot ? " (spot)" : ""}`),
    h("td", { class: "num" }, g.desired), h("td", { class: "num" }, g.actual), h("td", { class: "num" }, g.ready),
    h("td", {}, g.state || "not created"),
    h("td", { class: "wrap" }, g.last_error ? `${g.last_error} (${fmtTime(g.error_at)}, ${g.failures}×)` : "–")))));
}

function diffTable(diff) {
  const rows = [];
  for (const kind of ["added", "removed", "changed"]) {
    for (const c of diff[kind] || []) {
      rows.push(h("tr", { class: `diff-${kind}`, "data-diff": kind },
        h("td", {}, kind === "added" ? "+" : kind === "removed" ? "−" : "~"),
        h("td", {}, c.deployment), h("td", {}, h("code", {}, c.region)), h("td", {}, c.instance_type),
        h("td", { class: "num" }, `${c.replicas_before} → ${c.replicas_after}`),
        h("td", { class: "num" }, fmtMoney(c.cost_after - c.cost_before))));
    }
  }
  if (!rows.length) return h("p", { class: "muted" }, "No change from the plan in force.");
  return h("table", { class: "diff" },
    h("thead", {}, h("tr", {}, ["", "Deployment", "Region", "Instance", "Replicas", "Δ cost"].map((c) => h("th", {}, c)))),
    h("tbody", {}, rows));
}

export async function renderPlan(panel, key, viewer, refresh) {
  const [current, plans, progress] = await Promise.all([
    currentPlan(key), get(key, "/v1/placement/plans?limit=1"), get(key, "/v1/reconciler/status")]);
  // Only the newest plan can be waiting: an older preview was superseded when a newer plan came.
  const latest = plans[0] || null;
  const preview = latest && (latest.status === "preview" || latest.status === "infeasible") ? latest : null;
  const applicable = preview && preview.status === "preview" && preview.base_plan_id === (current ? current.id : null);
  const actions = panel.querySelector("#plan-actions");
  if (canOperate(viewer)) {
    const previewButton = h("button", { type: "button", class: "write", id: "plan-preview-button" }, "Preview a new plan");
    previewButton.addEventListener("click", async () => {
      previewButton.disabled = true;
      try { await post(key, "/v1/placement/plans", {}); } catch (e) { alert(`Preview failed: ${e.message}`); }
      refresh();
    });
    const buttons = [previewButton];
    if (applicable) {
      const apply = h("button", { type: "button", class: "write primary", id: "plan-apply-button", "data-plan": preview.id },
        `Apply ${short(preview.id)}`);
      apply.addEventListener("click", async () => {
        if (!confirm(`Apply plan ${short(preview.id)}? The reconciler will resize node groups to match it.`)) return;
        apply.disabled = true;
        try { await post(key, `/v1/placement/plans/${preview.id}/apply`); } catch (e) { alert(`Apply failed: ${e.message}`); }
        refresh();
      });
      buttons.push(apply);
    }
    replace(actions, buttons);
  } else {
    replace(actions);
  }
  replace(panel.querySelector("#plan-current"), h("div", { class: "plan-block" },
    h("h3", { id: "plan-state", class: `plan-state-${progress.state}`, "data-state": progress.state }, stateLabel(progress)),
    current
      ? [h("p", { class: "muted" }, `Plan ${short(current.id)} · ${fmtMoney(current.cost_per_hour)} · applied ${fmtTime(current.applied_at)} by ${current.applied_by || "?"}`),
        progress.state === "failing" ? null : h("p", { class: "muted", id: "plan-progress" }, progress.summary),
        groupsTable(progress.groups)]
      : h("p", { class: "muted" }, "Preview a plan and apply it to place the deployments.")));
  replace(panel.querySelector("#plan-preview"), h("div", { class: "plan-block", id: "plan-diff" },
    h("h3", {}, "Latest preview"),
    preview
      ? [h("p", { class: "muted" }, `Plan ${short(preview.id)} (${preview.status}) · ${fmtMoney(preview.cost_per_hour)} · by ${preview.created_by} at ${fmtTime(preview.created_at)}`
          + (preview.diff && preview.diff.cost_delta_per_hour !== undefined ? ` · Δ ${fmtMoney(preview.diff.cost_delta_per_hour)}` : "")),
        preview.status === "infeasible" ? h("p", { class: "error" }, preview.explanation || "infeasible") : diffTable(preview.diff || {})]
      : h("p", { class: "muted" }, "No preview waiting.")));
}

export async function renderDecisions(tbody, key) {
  const decisions = await get(key, "/v1/autoscaler/decisions?limit=12");
  replace(tbody, decisions.length ? decisions.map((d) => h("tr", { "data-decision": d.id },
    h("td", {}, fmtTime(d.at)), h("td", {}, d.model), h("td", {}, d.mode),
    h("td", { class: "num" }, `${d.current} → ${d.desired}`), h("td", { class: "wrap" }, d.reason)))
    : h("tr", {}, h("td", { colspan: 5, class: "muted" }, "No decision recorded yet.")));
}

// What an audit entry changed, in a few words (the reconciler's errors in full).
function eventDetail(e) {
  const before = e.before || {}, after = e.after || {};
  if (after.last_error) return after.last_error;
  if (e.resource_type === "node_group") {
    return after.current_size === undefined ? "removed" : `${before.current_size ?? 0} → ${after.current_size} nodes (target ${after.desired_size})`;
  }
  for (const field of ["desired_replicas", "desired_prefill_replicas"]) {
    if (field in after) return `${field.replaceAll("_", " ")}: ${before[field] ?? "–"} → ${after[field]}`;
  }
  if (e.resource_type === "placement_plan") return [after.status, fmtMoney(after.cost_per_hour)].filter(Boolean).join(" · ");
  return "";
}

export async function renderEvents(tbody, key) {
  const events = await get(key, "/v1/audit?limit=15");
  replace(tbody, events.length ? events.map((e) => h("tr", {
    "data-event": e.id, "data-action": e.action, "data-resource": e.resource_type,
    class: (e.after || {}).last_error ? "event-error" : "" },
  h("td", {}, fmtTime(e.at)), h("td", {}, e.actor_name), h("td", {}, e.action),
  h("td", {}, `${e.resource_type.replaceAll("_", " ")} `, h("code", {}, e.resource_id)),
  h("td", { class: "wrap" }, eventDetail(e))))
    : h("tr", {}, h("td", { colspan: 5, class: "muted" }, "Nothing has happened yet.")));
}

const SERIES_COLOURS = ["#60a5fa", "#a78bfa", "#34d399", "#fbbf24", "#f472b6", "#22d3ee", "#a3e635"];

// report.json's timeline as lines: requests/s per series, errors/s summed, the fault shaded.
function timelineChart(report) {
  const t = report.timeline || {};
  const starts = t.starts_s || [];
  const width = 640, height = 170, left = 34, bottom = 150, top = 12;
  if (!starts.length) return h("p", { class: "muted" }, "No timeline in this report.");
  const series = Object.entries(t.requests_per_s || {});
  const errors = starts.map((_, i) => Object.values(t.errors_per_s || {}).reduce((a, v) => a + (v[i] || 0), 0));
  const max = Math.max(1, ...series.flatMap(([, v]) => v), ...errors);
  const t0 = starts[0], t1 = starts[starts.length - 1] + (t.bucket_s || 1);
  const x = (sec) => left + ((sec - t0) / Math.max(t1 - t0, 1e-6)) * (width - left - 8);
  const y = (v) => bottom - (v / max) * (bottom - top);
  const line = (values) => values.map((v, i) => `${x(starts[i]).toFixed(1)},${y(v || 0).toFixed(1)}`).join(" ");
  const fault = report.fault || {};
  const parts = [
    s("line", { class: "axis", x1: left, y1: bottom, x2: width - 8, y2: bottom }),
    s("line", { class: "axis", x1: left, y1: top, x2: left, y2: bottom }),
    s("text", { x: 2, y: top + 8 }, `${max.toFixed(0)}/s`), s("text", { x: 20, y: bottom }, "0"),
  ];
  if (fault.start_s !== undefined) {
    parts.push(s("rect", { class: "fault", x: x(fault.start_s), y: top, width: Math.max(1, x(fault.end_s) - x(fault.start_s)), height: bottom - top },
      s("title", {}, `fault ${fault.kind || ""}`)));
  }
  series.forEach(([name, values], i) => parts.push(s("polyline", { points: line(values), fill: "none", stroke: SERIES_COLOURS[i % SERIES_COLOURS.length], "stroke-width": 1.5 },
    s("title", {}, `${name} requests/s`))));
  parts.push(s("polyline", { class: "errors", points: line(errors) }, s("title", {}, "errors/s")));
  (report.events || []).forEach((e, i) => {
    const ex = x(e.at_s);
    parts.push(s("line", { class: "event", x1: ex, y1: top, x2: ex, y2: bottom }),
      // Staggered so that events close in time stay legible; near the right edge, leftwards.
      s("text", { x: ex > width - 80 ? ex - 3 : ex + 3, y: top + 10 + (i % 4) * 11,
        "text-anchor": ex > width - 80 ? "end" : "start" }, e.action));
  });
  parts.push(s("text", { x: left, y: height - 4 }, `${t0.toFixed(0)} s`), s("text", { x: width - 40, y: height - 4 }, `${t1.toFixed(0)} s`));
  const legend = h("div", { class: "legend" }, series.map(([name], i) => h("span", {},
    h("span", { class: "swatch", "data-colour": SERIES_COLOURS[i % SERIES_COLOURS.length] }), name)),
    h("span", {}, h("span", { class: "swatch legend-down" }), "errors/s"),
    h("span", {}, h("span", { class: "swatch fault-swatch" }), "fault"));
  for (const sw of legend.querySelectorAll("[data-colour]")) sw.style.background = sw.dataset.colour;
  return [s("svg", { class: "timeline", viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "drill timeline" }, ...parts), legend];
}

async function showDrill(detail, key, summary) {
  const report = await get(key, `/v1/console/drills/${encodeURIComponent(summary.name)}/report.json`);
  const verdict = report.passed ? h("span", { class: "verdict-pass" }, "passed") : h("span", { class: "verdict-fail" }, "failed");
  const criteria = ((report.verdict || {}).criteria || []).map((c) => h("li", { class: c.passed ? "verdict-pass" : "verdict-fail" },
    `${c.passed ? "✓" : "✗"} ${c.name}: ${c.detail || ""}`));
  const png = h("div", {});
  if (summary.timeline_png) {
    const button = h("button", { type: "button" }, "Show timeline.png");
    button.addEventListener("click", async () => {
      const blob = await get(key, `/v1/console/drills/${encodeURIComponent(summary.name)}/timeline.png`, { accept: "blob" });
      replace(png, h("img", { class: "drill-png", alt: `${report.drill} timeline`, src: URL.createObjectURL(blob) }));
    });
    png.append(button);
  }
  replace(detail, h("div", { "data-drill": summary.name },
    h("h3", {}, report.drill, " · ", verdict),
    h("p", { class: "muted" }, `${report.started_at || ""} · ${report.duration_s ?? "?"} s · fault ${(report.fault || {}).kind || "?"}`
      + (report.recovery_s != null ? ` · recovered in ${report.recovery_s} s` : "")),
    h("p", {}, report.description || ""),
    timelineChart(report), h("ul", {}, criteria), png));
}

export async function renderDrills(list, detail, key, state) {
  const drills = await get(key, "/v1/console/drills");
  if (!drills.length) {
    replace(list, h("li", { class: "muted" }, "No drill reports (the control plane's MERIDIAN_CP_DRILL_REPORTS_DIR)."));
    return;
  }
  if (!state.drill || !drills.some((d) => d.name === state.drill)) state.drill = drills[0].name;
  replace(list, drills.map((d) => {
    const item = h("li", { class: d.name === state.drill ? "selected" : "", "data-drill": d.name },
      h("strong", {}, d.drill), " ", d.passed ? h("span", { class: "verdict-pass" }, "✓") : h("span", { class: "verdict-fail" }, "✗"),
      h("div", { class: "muted" }, `${d.fault || "?"} · ${d.started_at || ""}`));
    item.addEventListener("click", () => { state.drill = d.name; state.shownDrill = null; renderDrills(list, detail, key, state); });
    return item;
  }));
  if (state.shownDrill !== state.drill) {
    state.shownDrill = state.drill;
    const summary = drills.find((d) => d.name === state.drill);
    await showDrill(detail, key, summary);
  }
}
