// The fleet: the world map coloured by health, traffic per region, and the nodes.
//
// Request rates and mean latencies come from successive polls: each node's heartbeat carries
// its cumulative completed requests and their summed latency, stamped with the heartbeat's
// time, so a rate is (Δ requests / Δ heartbeat time) over the last RATE_WINDOW_S seconds.

import { fmtAge, fmtMs, fmtRate, h, replace, s, sparkline } from "./dom.js";
import { HEIGHT, LAND, WIDTH, project } from "./worldmap.js";

const RATE_WINDOW_S = 30;
const SPARK_POINTS = 30;
const ZONE_COLOURS = {
  eu: "#3b82f6", us: "#a855f7", apac: "#f97316", uk: "#06b6d4", ca: "#14b8a6",
  sa: "#84cc16", ch: "#f43f5e", me: "#eab308", il: "#ec4899",
};
const SPARE_COLOURS = ["#94a3b8", "#fb7185", "#2dd4bf", "#fbbf24", "#c084fc"];

export function zoneColour(zone) {
  if (ZONE_COLOURS[zone]) return ZONE_COLOURS[zone];
  let hash = 0;
  for (const c of zone) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return SPARE_COLOURS[hash % SPARE_COLOURS.length];
}

// Per-node samples of the cumulative counters, and per-region rate history for sparklines.
export class RateTracker {
  constructor() {
    this.samples = new Map();
    this.history = new Map();
  }

  observe(nodes) {
    for (const n of nodes) {
      const count = n.load.requests_completed;
      if (count === undefined || count === null) continue;
      const t = Date.parse(n.last_heartbeat) / 1000;
      let list = this.samples.get(n.node_id) || [];
      const last = list[list.length - 1];
      if (last && count < last.count) list = []; // the node restarted: its counters did too
      if (!last || t > last.t) list.push({ t, count, sum: n.load.latency_s_sum || 0 });
      this.samples.set(n.node_id, list.filter((x) => x.t >= t - RATE_WINDOW_S));
    }
  }

  // {rate, dCount, dSum} of a node over the window, or null before two heartbeats were seen.
  node(nodeId) {
    const list = this.samples.get(nodeId);
    if (!list || list.length < 2) return null;
    const a = list[0], b = list[list.length - 1];
    const dt = b.t - a.t;
    return dt > 0 ? { rate: (b.count - a.count) / dt, dCount: b.count - a.count, dSum: b.sum - a.sum } : null;
  }

  region(nodes) {
    let rate = 0, dCount = 0, dSum = 0, measured = false;
    for (const n of nodes) {
      if (n.status === "lost") continue;
      const r = this.node(n.node_id);
      if (!r) continue;
      measured = true;
      rate += r.rate; dCount += r.dCount; dSum += r.dSum;
    }
    return measured ? { rate, latency: dCount > 0 ? dSum / dCount : null } : null;
  }

  remember(region, rate) {
    const list = this.history.get(region) || [];
    list.push(rate);
    this.history.set(region, list.slice(-SPARK_POINTS));
    return this.history.get(region);
  }
}

// A node counts as ready when it says so and its heartbeat is within the TTL.
export function nodeState(node, overview) {
  const age = (Date.parse(overview.generated_at) - Date.parse(node.last_heartbeat)) / 1000;
  let shown = node.status;
  if (node.status !== "lost" && age > Math.max(3 * overview.heartbeat_interval_s, 1)) shown = "late";
  return { age: Math.max(0, age), shown, ready: node.status === "ready" && shown !== "late" };
}

function healthOf(nodes, overview) {
  const ready = nodes.filter((n) => nodeState(n, overview).ready).length;
  const health = ready === nodes.length ? "ok" : ready === 0 ? "down" : "degraded";
  return { ready, total: nodes.length, health };
}

export function byRegion(overview) {
  const groups = new Map();
  for (const n of overview.nodes) {
    if (!groups.has(n.region)) groups.set(n.region, []);
    groups.get(n.region).push(n);
  }
  return groups;
}

export function renderMap(svg, legend, overview, groups) {
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  const sites = [], markers = [];
  const zones = new Map();
  for (const r of overview.regions) {
    for (const z of r.zones) zones.set(z, (zones.get(z) || 0) + 1);
    const [x, y] = project(r.latitude, r.longitude);
    const colour = zoneColour(r.zones[0] || "global");
    const nodes = groups.get(r.name);
    if (!nodes) {
      sites.push(s("circle", { class: "site", cx: x, cy: y, r: 3, stroke: colour },
        s("title", {}, `${r.name} (${r.zones.join(", ") || "no zone"}): no nodes`)));
      continue;
    }
    const hl = healthOf(nodes, overview);
    markers.push(s("g", { class: "region", "data-region": r.name, "data-health": hl.health, "data-ready": hl.ready },
      s("circle", { class: `health health-${hl.health}`, cx: x, cy: y, r: 8, stroke: colour }),
      // Labels of regions near the right edge go to the left of their marker.
      x > WIDTH * 0.8
        ? s("text", { x: x - 12, y: y + 4, "text-anchor": "end" }, `${r.name}  ${hl.ready}/${hl.total} ready`)
        : s("text", { x: x + 12, y: y + 4 }, `${r.name}  ${hl.ready}/${hl.total} ready`),
      s("title", {}, `${r.name} · zones ${r.zones.join(", ")} · ${hl.ready} of ${hl.total} nodes ready`)));
  }
  replace(svg, s("path", { class: "land", d: LAND }), ...sites, ...markers);
  const zoneItems = [...zones.keys()].sort().map((z) => h("span", { "data-zone": z },
    h("span", { class: "swatch", "data-colour": zoneColour(z) }), `${z} (${zones.get(z)} regions)`));
  const healthItems = [["ok", "all nodes ready"], ["degraded", "some ready"], ["down", "none ready"]].map(
    ([k, label]) => h("span", {}, h("span", { class: `swatch legend-${k}` }), label));
  replace(legend, h("span", { class: "muted" }, "Ring: residency zone"), ...zoneItems, h("span", { class: "sep" }),
    h("span", { class: "muted" }, "Fill: health"), ...healthItems);
  // Colours set through the CSSOM: the policy allows no inline style attributes.
  for (const sw of legend.querySelectorAll("[data-colour]")) sw.style.borderColor = sw.dataset.colour;
}

export function renderRegions(tbody, overview, groups, rates) {
  const rows = [];
  for (const r of overview.regions) {
    const nodes = groups.get(r.name);
    if (!nodes) continue;
    const hl = healthOf(nodes, overview);
    const live = nodes.filter((n) => n.status !== "lost");
    const traffic = rates.region(nodes);
    const history = rates.remember(r.name, traffic ? traffic.rate : 0);
    rows.push(h("tr", { "data-region": r.name, "data-health": hl.health },
      h("td", {}, h("code", {}, r.name)),
      h("td", {}, r.zones.join(", ")),
      h("td", { class: `num health-text-${hl.health}` }, `${hl.ready} / ${hl.total}`),
      h("td", { class: "num" }, live.reduce((a, n) => a + n.load.running, 0)),
      h("td", { class: "num" }, live.reduce((a, n) => a + n.load.waiting, 0)),
      h("td", { class: "num", "data-rate": traffic ? traffic.rate.toFixed(3) : "" }, fmtRate(traffic && traffic.rate)),
      h("td", { class: "num" }, fmtMs(traffic && traffic.latency)),
      h("td", {}, sparkline(history))));
  }
  replace(tbody, rows.length ? rows : h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No node has registered yet.")));
}

// Requests the routers' flow control holds per (zone, model): the backlog no node reports,
// which the autoscaler counts with the nodes' running and waiting.
export function renderHeld(tbody, overview) {
  const rows = (overview.router_backlog || []).map((p) =>
    h("tr", { "data-zone": p.zone, "data-model": p.model },
      h("td", {}, p.zone),
      h("td", {}, h("code", {}, p.model)),
      h("td", { class: "num" }, p.waiting),
      h("td", { class: "num" }, p.routers)));
  replace(tbody, rows.length ? rows : h("tr", {}, h("td", { colspan: 4, class: "muted" }, "Nothing waits at the routers.")));
}

export function coldStartText(c) {
  if (!c) return "–";
  const steps = [];
  if (c.weights_cached_s != null) steps.push(`weights ${c.weights_cached_s.toFixed(1)}s (${c.weights_source || "?"})`);
  if (c.loaded_s != null) steps.push(`loaded ${c.loaded_s.toFixed(1)}s`);
  if (c.ready_s != null) steps.push(`ready ${c.ready_s.toFixed(1)}s`);
  return steps.join(" → ") || "starting";
}

// The cold start as a bar: weights, then loading, then ready, on a scale shared by all nodes.
function coldStartBar(c, scale) {
  const width = 110, k = width / Math.max(scale, 1e-6);
  const parts = [];
  let at = 0;
  for (const [cls, end] of [["weights", c.weights_cached_s], ["load", c.loaded_s], ["ready", c.ready_s]]) {
    if (end == null) continue;
    const w = Math.max(1, (end - at) * k);
    parts.push(s("rect", { class: cls, x: at * k, y: 1, width: w, height: 8 }));
    at = end;
  }
  return s("svg", { class: "coldstart", width, height: 10, viewBox: `0 0 ${width} 10` }, ...parts);
}

export function renderNodes(tbody, overview, rates) {
  const scale = Math.max(0, ...overview.nodes.map((n) => (n.cold_start && n.cold_start.ready_s) || 0));
  const rows = overview.nodes.map((n) => {
    const st = nodeState(n, overview);
    const r = n.status === "lost" ? null : rates.node(n.node_id);
    const kv = Math.round(n.load.kv_cache_usage * 100);
    const bar = h("span", { class: "bar" }, h("span", { "data-width": kv }));
    return h("tr", { "data-node": n.node_id, "data-status": st.shown, class: `node-${st.shown}` },
      h("td", {}, h("code", {}, n.node_id)),
      h("td", {}, h("code", {}, n.region)),
      h("td", {}, n.engine),
      h("td", {}, n.models.join(", ")),
      h("td", {}, h("span", { class: `status status-${st.shown}` }, st.shown)),
      h("td", { class: "num" }, `${n.load.running} / ${n.load.waiting}`),
      h("td", {}, bar, `${kv}%`),
      h("td", { class: "num" }, fmtRate(r && r.rate)),
      h("td", { class: "num" }, fmtMs(r && r.dCount > 0 ? r.dSum / r.dCount : null)),
      h("td", { class: "coldstart-cell", title: coldStartText(n.cold_start) },
        n.cold_start ? coldStartBar(n.cold_start, scale) : null, coldStartText(n.cold_start)),
      h("td", { class: "num" }, fmtAge(st.age)));
  });
  replace(tbody, rows.length ? rows : h("tr", {}, h("td", { colspan: 11, class: "muted" }, "No nodes.")));
  for (const b of tbody.querySelectorAll("[data-width]")) b.style.width = `${b.dataset.width}%`;
}
