// The console's entry point: the login screen, then a poll of the admin API every few seconds.
// The key lives in sessionStorage (this tab only) and goes out only as the Authorization header.

import { ApiError, forgetKey, get, loginMessage, saveKey, savedKey } from "./api.js";
import { fmtTime, replace } from "./dom.js";
import { RateTracker, byRegion, renderHeld, renderMap, renderNodes, renderRegions } from "./fleet.js";
import { renderDecisions, renderDrills, renderEvents, renderPlan } from "./panels.js";

const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(500, Number(params.get("poll_ms")) || 3000);
const $ = (sel) => document.querySelector(sel);

let session = null; // {key, viewer, timer, rates, drills}

function showLogin(message) {
  if (session && session.timer) clearTimeout(session.timer);
  session = null;
  $("#console").hidden = true;
  $("#login").hidden = false;
  const error = $("#login-error");
  error.hidden = !message;
  error.textContent = message || "";
  $("#api-key").focus();
}

function showConsole() {
  $("#login").hidden = true;
  $("#console").hidden = false;
}

// One panel failing (a drill directory gone, a slow plan listing) never blanks the others.
async function guarded(name, work) {
  try {
    await work();
    return null;
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) throw e;
    return `${name}: ${e.message}`;
  }
}

async function poll() {
  const current = session;
  if (!current) return;
  const overview = await get(current.key, "/v1/console/overview");
  if (session !== current) return;
  current.viewer = overview.viewer;
  current.rates.observe(overview.nodes);
  const groups = byRegion(overview);
  renderMap($("#map"), $("#legend"), overview, groups);
  renderRegions($("#regions tbody"), overview, groups, current.rates);
  renderHeld($("#held tbody"), overview);
  renderNodes($("#nodes tbody"), overview, current.rates);
  $("#routing-version").textContent = `routing v${overview.routing_version}`;
  $("#viewer").textContent = `${overview.viewer.name} · ${overview.viewer.scopes.join(", ")}`;
  const problems = (await Promise.all([
    guarded("placement", () => renderPlan($("#plan-panel"), current.key, overview.viewer, refresh)),
    guarded("autoscaler", () => renderDecisions($("#decisions tbody"), current.key)),
    guarded("events", () => renderEvents($("#events tbody"), current.key)),
    guarded("drills", () => renderDrills($("#drill-list"), $("#drill-detail"), current.key, current.drills)),
  ])).filter(Boolean);
  const pollError = $("#poll-error");
  pollError.hidden = problems.length === 0;
  pollError.textContent = problems.join("; ");
  $("#updated").textContent = `updated ${fmtTime(overview.generated_at)}`;
  $("#updated").dataset.at = overview.generated_at;
}

async function tick() {
  const current = session;
  if (!current) return;
  try {
    await poll();
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) {
      forgetKey();
      showLogin(loginMessage(e));
      return;
    }
    const pollError = $("#poll-error");
    pollError.hidden = false;
    pollError.textContent = `update failed: ${e.message} (retrying)`;
  }
  if (session === current) current.timer = setTimeout(tick, POLL_MS);
}

function refresh() {
  if (!session) return;
  clearTimeout(session.timer);
  tick();
}

async function login(key) {
  const button = $("#login-button");
  button.disabled = true;
  try {
    const overview = await get(key, "/v1/console/overview");
    saveKey(key);
    session = { key, viewer: overview.viewer, timer: null, rates: new RateTracker(), drills: {} };
    $("#api-key").value = "";
    showConsole();
    await tick();
  } catch (e) {
    forgetKey();
    showLogin(e instanceof ApiError ? loginMessage(e) : String(e));
  } finally {
    button.disabled = false;
  }
}

$("#login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  if (key) login(key);
});
$("#logout").addEventListener("click", () => {
  forgetKey();
  replace($("#drill-detail"));
  showLogin(null);
});

const remembered = savedKey();
if (remembered) login(remembered);
else showLogin(null);
