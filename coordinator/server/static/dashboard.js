// Shoal's dashboard: polls the JSON endpoints of `shoal serve` (docs/dashboard.md) once a
// second and draws the cluster, the speed, the heat map, the rebalance and a chat. Plain
// browser JavaScript modules, no libraries: the page works offline. This one holds the key
// form, the cluster cards, the rebalance and the loop; the other sections have their own.

import { renderSpeed, short } from "./dashboard-charts.js";
import "./dashboard-chat.js";
import {
  $, KEY, Refused, ago, bytes, esc, getJSON, headers, hooks, num, pct, setStatus, state, timed,
  uptime,
} from "./dashboard-common.js";
import { WORKER_COLOURS, heatView, renderHeat } from "./dashboard-heat.js";

const TICK_MS = 1000;
const HEAT_MS = 2000;

// a latency series' median and 99th percentile, in ms
function seconds(series) {
  if (!series || series.p50 === null) return "none yet";
  const ms = (x) => `${(x * 1000).toFixed(x < 0.1 ? 1 : 0)} ms`;
  return `${ms(series.p50)} / ${ms(series.p99)}`;
}

function askForKey(message) {
  stop();
  $("main").hidden = true;
  $("key-panel").hidden = false;
  $("key-message").textContent = message || "";
  setStatus("needs the API key", "warn");
  $("key-input").focus();
}

async function checkKey() {
  const reply = await fetch("/api/auth", { headers: headers(), cache: "no-store" });
  const body = await reply.json();
  $("forget-key").hidden = !body.key_required || !state.key;
  if (body.key_required && !body.authorized) {
    askForKey(state.key ? "the server refused this key" : "");
    return false;
  }
  return true;
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.key = $("key-input").value.trim();
  sessionStorage.setItem(KEY, state.key);
  $("key-input").value = "";
  if (await checkKey()) begin();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  state.key = null;
  askForKey("");
  $("forget-key").hidden = true;
});

// -- the cluster ------------------------------------------------------------------------

function renderCluster(body) {
  const c = body.coordinator;
  state.model = c.model;
  $("model").textContent = `${c.model} (${c.model_type})`;
  $("cluster-name").textContent = body.cluster;
  const healthyWorkers = body.workers.filter((w) => w.healthy).length;
  const cards = [`
    <div class="card coordinator" data-role="coordinator">
      <h3><span>coordinator</span><span class="pill ${c.healthy ? "good" : "bad"}">
        ${c.healthy ? "serving" : "unavailable"}</span></h3>
      <dl>
        <dt>model</dt><dd>${esc(c.model)}</dd>
        <dt>MoE layers, experts</dt><dd>${c.moe_layers}, ${c.experts}</dd>
        <dt>workers healthy</dt><dd>${healthyWorkers} of ${body.workers.length}</dd>
        <dt>requests in flight</dt><dd>${c.in_flight} of ${c.max_batch}</dd>
        <dt>context</dt><dd>${c.context} tokens</dd>
        <dt>prompt cache</dt><dd>${c.prompt_cache.entries} entries, ${bytes(c.prompt_cache.bytes)}${
          c.prompt_cache.disk ? `; on disk ${c.prompt_cache.disk.entries}, ${bytes(c.prompt_cache.disk.bytes)}` : ""}</dd>
        <dt>first token p50 / p99</dt><dd data-metric="first-token">${seconds(c.latency?.first_token)}</dd>
        <dt>token gap p50 / p99</dt><dd data-metric="token-gap">${seconds(c.latency?.gap)}</dd>
        ${c.drafting ? `<dt>draft (${esc(c.drafting.draft)}) acceptance</dt><dd data-metric="draft-acceptance">${
          (100 * c.drafting.acceptance_rate).toFixed(0)}%, ${c.drafting.tokens_per_step.toFixed(2)} tokens per step</dd>` : ""}
        <dt>up</dt><dd>${esc(uptime(c.started))}</dd>
      </dl>
      ${c.detail ? `<div class="detail">${esc(c.detail)}</div>` : ""}
    </div>`];
  for (const w of body.workers) {
    const used = w.resident_bytes ?? null;
    const share = used !== null && w.memory_budget ? Math.min(1, used / w.memory_budget) : 0;
    const link = w.interface ? `${w.path} (${w.interface})` : w.path;
    cards.push(`
    <div class="card worker ${w.healthy ? "healthy" : "unhealthy"}" data-node="${esc(w.node_id)}"
         data-address="${esc(w.address)}" data-state="${esc(w.state)}">
      <h3><span>${esc(w.node_id)}</span><span class="pill ${w.healthy ? "good" : "bad"}">${esc(w.state)}</span></h3>
      <div class="muted">${esc(ago(w.since))}</div>
      <dl>
        <dt>address</dt><dd>${esc(w.address)}</dd>
        <dt>link</dt><dd>${esc(link)}</dd>
        <dt>experts</dt><dd>${w.experts} (${w.replicas} also elsewhere)</dd>
        <dt>memory</dt><dd>${bytes(used)} of ${bytes(w.memory_budget)}</dd>
      </dl>
      <div class="bar"><span style="width:${(100 * share).toFixed(1)}%"></span></div>
      <dl>
        <dt>free disk</dt><dd>${bytes(w.free_disk)}</dd>
        <dt>cache hit rate</dt><dd>${pct(w.hit_rate)}</dd>
        <dt>prefetch recall</dt><dd>${pct(w.prefetch_recall)}</dd>
        <dt>drive reads/s</dt><dd>${num(w.drive_reads_per_s)}</dd>
        <dt>round trip</dt><dd>${w.rtt_ms === null ? "-" : `${w.rtt_ms.toFixed(2)} ms`}</dd>
      </dl>
      ${w.detail ? `<div class="detail">${esc(w.detail)}</div>` : ""}
      ${(w.problems || []).map((p) => `<div class="detail">${esc(p)}</div>`).join("")}
    </div>`);
  }
  $("cards").innerHTML = cards.join("");
}

// -- rebalance --------------------------------------------------------------------------

async function loadPlan() {
  $("plan-again").disabled = true;
  try {
    const body = await getJSON("/api/rebalance/plan");
    timed("plan", () => renderPlan(body));
  } catch (e) {
    if (!(e instanceof Refused)) $("plan-lines").textContent = `no plan: ${e.message}`;
  } finally {
    $("plan-again").disabled = false;
  }
}

function renderPlan(body) {
  const p = body.plan;
  if (!p) {
    $("plan-figures").innerHTML = "";
    $("plan-lines").textContent = body.reason;
    return;
  }
  const count = (kind) => p.steps.filter((s) => s.kind === kind).length;
  $("plan-figures").innerHTML = [
    [String(count("copy")), "copies"], [bytes(p.copy_bytes), "to send"],
    [String(count("delete")), "drops"], [String(p.steps.length), "steps"],
    [num(p.imbalance_now, 2), "predicted imbalance now"],
    [num(p.imbalance_after, 2), "after"],
  ].map(([v, label]) => `<div><b>${esc(v)}</b><span>${esc(label)}</span></div>`).join("");
  $("plan-lines").textContent = body.lines.join("\n");
}

async function startRebalance() {
  $("start-rebalance").disabled = true;
  try {
    const reply = await fetch("/api/rebalance", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: "{}" });
    const body = await reply.json();
    if (!reply.ok) throw new Error(body.error ? body.error.message : String(reply.status));
    state.rebalanceRunning = true;
    renderProgress(body);
  } catch (e) {
    $("progress").hidden = false;
    $("progress-text").textContent = `not started: ${e.message}`;
    $("start-rebalance").disabled = false;
  }
}

function renderProgress(s) {
  if (s.state === "idle") return;
  $("progress").hidden = false;
  const bar = $("progress-bar");
  bar.max = s.steps_planned || 1;
  bar.value = Math.min(s.steps_done, bar.max);
  const sent = s.bytes_planned ? `${bytes(s.bytes_sent)} of ${bytes(s.bytes_planned)}` : bytes(s.bytes_sent);
  const planned = s.steps_planned === null ? "?" : s.steps_planned;
  $("progress-text").textContent = `${s.state}: ${s.steps_done} of ${planned} steps, ` +
    `${sent} sent${s.step ? `; ${s.step}` : ""}${s.error ? `; ${s.error}` : ""}`;
  $("rebalance-log").textContent = (s.lines || s.log || []).join("\n");
  const running = s.state === "running";
  $("start-rebalance").disabled = running;
  if (state.rebalanceRunning && !running) loadPlan();
  state.rebalanceRunning = running;
}

$("plan-again").addEventListener("click", loadPlan);
$("start-rebalance").addEventListener("click", startRebalance);

// -- the loop ---------------------------------------------------------------------------

async function tick() {
  const started = performance.now();
  try {
    const since = state.samples.length ? `?since=${state.samples[state.samples.length - 1].t}` : "";
    const [cluster, speed] = await Promise.all([getJSON("/api/cluster"), getJSON(`/api/speed${since}`)]);
    timed("cluster", () => renderCluster(cluster));
    timed("speed", () => renderSpeed(speed));
    if (started - state.heatAt >= HEAT_MS) {
      state.heatAt = started;
      const heat = await getJSON("/api/heat");
      timed("heat", () => renderHeat(heat));
    }
    if (state.rebalanceRunning) {
      const progress = await getJSON("/api/rebalance");
      timed("rebalance", () => renderProgress(progress));
    }
    setStatus(`live, ${new Date().toLocaleTimeString()}`, cluster.coordinator.healthy ? "good" : "bad");
  } catch (e) {
    if (e instanceof Refused) return;
    setStatus(`cannot reach the server: ${e.message}`, "bad");
  }
  if (state.live) state.timer = setTimeout(tick, Math.max(0, TICK_MS - (performance.now() - started)));
}

function stop() {
  state.live = false;
  clearTimeout(state.timer);
}

async function begin() {
  $("key-panel").hidden = true;
  $("main").hidden = false;
  state.live = true;
  const status = await getJSON("/api/rebalance").catch(() => null);
  if (status) renderProgress(status);
  state.rebalanceRunning = Boolean(status && status.state === "running");
  tick();
  loadPlan();
}


window.shoalDashboard = {
  ...heatView,
  workerColours() { return WORKER_COLOURS.slice(); },
  shortNumber: short,
};

hooks.refused = askForKey;
checkKey().then((ok) => { if (ok) begin(); }).catch((e) => setStatus(`cannot reach the server: ${e.message}`, "bad"));
