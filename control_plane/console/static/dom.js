// DOM and formatting helpers. Text always goes in as text nodes (never as HTML), so a node id
// or a drill's description shown on the page cannot become markup.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.setAttribute("class", v);
    else if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

export function replace(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}

export function fmtRate(x) {
  if (x === null || x === undefined) return "–";
  return x >= 10 ? x.toFixed(0) : x.toFixed(2);
}

export function fmtMs(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const ms = seconds * 1000;
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(0)} ms`;
}

export function fmtAge(seconds) {
  if (seconds < 1) return "now";
  if (seconds < 90) return `${seconds.toFixed(0)}s ago`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(0)}m ago`;
  return `${(seconds / 3600).toFixed(1)}h ago`;
}

export function fmtTime(iso) {
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleTimeString();
}

export function fmtMoney(x) {
  return x === null || x === undefined ? "–" : `$${Number(x).toFixed(2)}/h`;
}

export function short(id) {
  return String(id).slice(0, 8);
}

// A small line chart of `values` (nulls break nothing: they are drawn as zero).
export function sparkline(values, width = 90, height = 18) {
  const max = Math.max(1e-9, ...values.map((v) => v || 0));
  const step = values.length > 1 ? width / (values.length - 1) : width;
  const points = values.map((v, i) => `${(i * step).toFixed(1)},${(height - 1 - ((v || 0) / max) * (height - 2)).toFixed(1)}`);
  return s("svg", { width, height, viewBox: `0 0 ${width} ${height}`, "aria-hidden": "true" },
    s("polyline", { class: "spark", points: points.join(" ") }));
}
