// Shoal's dashboard: polls the JSON endpoints of `shoal serve` (docs/dashboard.md) once a
// second and draws the cluster, the speed, the heat map, the rebalance and a chat. Plain
// browser JavaScript, no libraries: the page works offline.
"use strict";

(() => {
  const KEY = "shoal-api-key"; // sessionStorage: kept for this tab, never put in a URL
  const TICK_MS = 1000;
  const HEAT_MS = 2000;
  const AXIS_BOTTOM = 14; // px under a chart for its time labels
  // Outlines over the heat ramp (black, purples, reds, oranges, yellow): hues it has not,
  // far apart from each other, the first ones the most different.
  const WORKER_COLOURS = ["#00e5ff", "#76ff03", "#ffffff", "#2962ff", "#ff4dff", "#9e9e9e",
                          "#1de9b6", "#b388ff", "#00838f", "#33691e"];
  const HEAT_LEFT = 44, HEAT_TOP = 18; // room for the layer and expert labels
  // inferno-like stops, dark (cold) to light (hot)
  const RAMP = [[0, 0, 4], [40, 11, 84], [101, 21, 110], [159, 42, 99], [212, 72, 66],
                [245, 125, 21], [250, 193, 39], [252, 255, 164]];
  const COLOURS = Array.from({ length: 256 }, (_, i) => ramp(i / 255).map(Math.round));
  const PART_COLOURS = {
    sync: "#6c757d", send: "#4cc9f0", wire: "#f72585", worker_parse: "#b8c0ff",
    worker_matrix: "#80ed99", worker_bookkeeping: "#ffd166", worker_reads: "#c77dff",
    worker_reply: "#2ec4b6",
    parse_scatter: "#f4a261",
  };
  const STACKED = Object.keys(PART_COLOURS);
  // each part's colour as one RGBA pixel of a Uint32Array over ImageData (byte order kept)
  const PART_PIXELS = STACKED.map((p) => {
    const bytes = new Uint8ClampedArray(4);
    const hex = PART_COLOURS[p];
    [1, 3, 5].forEach((at, i) => { bytes[i] = parseInt(hex.slice(at, at + 2), 16); });
    bytes[3] = 255;
    return new Uint32Array(bytes.buffer)[0];
  });

  const $ = (id) => document.getElementById(id);
  const state = {
    key: sessionStorage.getItem(KEY),
    live: false,
    model: null,
    samples: [],
    history: 300,
    heatAt: -Infinity,
    heat: null,
    heatGeometry: null,
    rebalanceRunning: false,
    chat: [],
    timer: null,
  };

  class Refused extends Error {}

  // -- helpers --------------------------------------------------------------------------

  function esc(text) {
    return String(text ?? "").replace(/[&<>"']/g, (c) => ({
      "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }

  function bytes(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
  }

  const pct = (x) => (x === null || x === undefined ? "-" : `${(100 * x).toFixed(1)}%`);
  const num = (x, digits = 1) => (x === null || x === undefined ? "-" : x.toFixed(digits));

  function ago(wall) {
    if (!wall) return "";
    const s = Math.max(0, Date.now() / 1000 - wall);
    const clock = new Date(wall * 1000).toLocaleTimeString();
    if (s < 90) return `since ${clock} (${Math.round(s)} s)`;
    if (s < 5400) return `since ${clock} (${Math.round(s / 60)} min)`;
    return `since ${clock} (${(s / 3600).toFixed(1)} h)`;
  }

  function uptime(wall) {
    const s = Math.max(0, Date.now() / 1000 - wall);
    if (s < 90) return `${Math.round(s)} s`;
    if (s < 5400) return `${Math.round(s / 60)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (state.key) h.Authorization = `Bearer ${state.key}`;
    return h;
  }

  async function getJSON(path) {
    const reply = await fetch(path, { headers: headers(), cache: "no-store" });
    if (reply.status === 401) { askForKey("the server refused this key"); throw new Refused(); }
    const body = await reply.json();
    if (!reply.ok) throw new Error(body.error ? body.error.message : `${path}: ${reply.status}`);
    return body;
  }

  // Each update's script time goes to the browser's performance timeline as a measure.
  function timed(name, draw) {
    const start = performance.now();
    try { draw(); } finally {
      performance.measure(`shoal:${name}`, { start, end: performance.now() });
    }
  }

  function setStatus(text, kind) {
    const s = $("status");
    s.textContent = text;
    s.className = `pill ${kind || ""}`;
  }

  function ramp(v) {
    const x = Math.min(1, Math.max(0, v)) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(x));
    const f = x - i;
    const a = RAMP[i], b = RAMP[i + 1];
    return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
  }

  // -- the key ----------------------------------------------------------------------------

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
          <dt>prompt cache</dt><dd>${c.prompt_cache.entries} entries, ${bytes(c.prompt_cache.bytes)}</dd>
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

  // -- speed ------------------------------------------------------------------------------

  function renderSpeed(body) {
    state.history = body.history;
    state.samples.push(...body.samples);
    if (state.samples.length > state.history) {
      state.samples.splice(0, state.samples.length - state.history);
    }
    const last = state.samples[state.samples.length - 1];
    if (!last) return;
    const widest = Math.max(0, ...state.samples.map((s) => s.batch_width));
    $("speed-figures").innerHTML = [
      [num(last.decode_tps), "decode tokens/s (last second)"],
      [String(last.in_flight), "requests in flight"],
      [num(last.batch_width, 2), "batch width (tokens per step)"],
      [num(widest, 2), "widest, last minutes"],
      [last.breakdown ? num(last.breakdown.round_trip_us / 1000, 2) : "-", "ms per MoE layer call"],
    ].map(([v, label]) => `<div><b>${esc(v)}</b><span>${esc(label)}</span></div>`).join("");
    drawLine($("tps-chart"), state.samples.map((s) => s.decode_tps));
    drawStacked($("breakdown-chart"), state.samples);
    if (!$("breakdown-legend").childElementCount) {
      const labels = Object.fromEntries(body.parts);
      $("breakdown-legend").innerHTML = STACKED.map((p) =>
        `<span><i style="background:${PART_COLOURS[p]}"></i>${esc(labels[p] || p)}</span>`).join("");
    }
  }

  function chartContext(canvas) {
    const width = canvas.clientWidth || 340;
    if (canvas.width !== width) canvas.width = width;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    return ctx;
  }

  // 86800 -> "86.8k", 0.25 -> "0.25": a scale read at a glance, never 8.68e+4
  function short(x) {
    const units = [[1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [size, unit] of units) {
      if (Math.abs(x) >= size) return `${Number((x / size).toPrecision(3))}${unit}`;
    }
    return String(Number(x.toPrecision(3)));
  }

  // The scale at its top and middle, and the time along the bottom (one sample a second,
  // the newest at the right edge).
  function axis(ctx, canvas, top) {
    ctx.fillStyle = "#8b93a3";
    ctx.font = "11px system-ui";
    const plot = canvas.height - AXIS_BOTTOM;
    ctx.fillText(short(top), 2, 11);
    ctx.fillText(short(top / 2), 2, plot - (plot - 14) / 2 + 4);
    ctx.strokeStyle = "#2c313c";
    ctx.beginPath();
    ctx.moveTo(0, plot - 0.5);
    ctx.lineTo(canvas.width, plot - 0.5);
    ctx.stroke();
    const seconds = Math.max(1, state.history - 1);
    const every = seconds > 150 ? 60 : seconds > 60 ? 30 : 10;
    ctx.textAlign = "center";
    for (let ago = 0; ago <= seconds; ago += every) {
      const x = canvas.width - (ago / seconds) * canvas.width;
      const label = ago === 0 ? "now" : ago % 60 ? `-${ago} s` : `-${ago / 60} min`;
      ctx.textAlign = ago === 0 ? "right" : x < 20 ? "left" : "center";
      ctx.fillText(label, x, canvas.height - 2);
    }
    ctx.textAlign = "left";
  }

  function drawLine(canvas, values) {
    const ctx = chartContext(canvas);
    const top = Math.max(1e-9, ...values) * 1.1;
    const step = canvas.width / Math.max(1, state.history - 1);
    const x0 = canvas.width - (values.length - 1) * step;
    ctx.strokeStyle = "#4cc9f0";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    values.forEach((v, i) => {
      const plot = canvas.height - AXIS_BOTTOM;
      const x = x0 + i * step, y = plot - (v / top) * (plot - 14);
      if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    });
    ctx.stroke();
    axis(ctx, canvas, top / 1.1);
  }

  // Drawn into pixels, not as paths: a few hundred anti-aliased rectangles per part cost the
  // browser's software raster far more than filling the columns here.
  function drawStacked(canvas, samples) {
    const ctx = chartContext(canvas);
    const w = canvas.width, h = canvas.height - AXIS_BOTTOM;
    const totals = samples.map((s) => (s.breakdown ? STACKED.reduce(
      (sum, p) => sum + (s.breakdown[`${p}_us`] || 0), 0) : 0));
    const top = Math.max(1e-9, ...totals) * 1.1;
    const step = w / Math.max(1, state.history - 1);
    const x0 = w - (samples.length - 1) * step;
    const scale = (h - 14) / top;
    const image = ctx.createImageData(w, canvas.height);
    const px = new Uint32Array(image.data.buffer);
    samples.forEach((s, i) => {
      if (!s.breakdown) return;
      const left = Math.max(0, Math.round(x0 + (i - 0.5) * step));
      const right = Math.min(w, Math.max(left + 1, Math.round(x0 + (i + 0.5) * step)));
      let y = h;
      STACKED.forEach((p, k) => {
        const next = y - (s.breakdown[`${p}_us`] || 0) * scale;
        for (let row = Math.max(0, Math.round(next)); row < Math.round(y); row++) {
          px.fill(PART_PIXELS[k], row * w + left, row * w + right);
        }
        y = next;
      });
    });
    ctx.putImageData(image, 0, 0);
    axis(ctx, canvas, top / 1.1);
  }

  // -- heat -------------------------------------------------------------------------------

  function renderHeat(h) {
    state.heat = h;
    const canvas = $("heat-map");
    const rows = h.layers.length;
    const width = Math.max(1, ...h.experts);
    const room = Math.max(300, $("heat").clientWidth - 16 - HEAT_LEFT);
    const cw = Math.max(2, Math.floor(room / width)); // the section's whole width
    const ch = Math.max(3, Math.min(28, Math.floor(540 / Math.max(1, rows))));
    canvas.width = HEAT_LEFT + width * cw;
    canvas.height = HEAT_TOP + rows * ch;
    const ctx = canvas.getContext("2d");
    heatAxes(ctx, h, width, cw, ch);
    ctx.translate(HEAT_LEFT, HEAT_TOP);
    // One pixel per cell, then scaled up without smoothing: far fewer pixels to write.
    const small = state.heatPixels || (state.heatPixels = document.createElement("canvas"));
    small.width = width;
    small.height = rows;
    const sctx = small.getContext("2d");
    const image = sctx.createImageData(width, rows);
    const px = image.data;
    const logMax = Math.log1p(h.max) || 1;
    for (let r = 0; r < rows; r++) {
      const counts = h.counts[r];
      for (let e = 0, i = r * width * 4; e < counts.length; e++, i += 4) {
        const c = COLOURS[Math.round(255 * Math.log1p(counts[e]) / logMax)];
        px[i] = c[0]; px[i + 1] = c[1]; px[i + 2] = c[2]; px[i + 3] = 255;
      }
    }
    sctx.putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(small, 0, 0, width * cw, rows * ch);
    outlineOwners(ctx, h, cw, ch);
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    state.heatGeometry = { cw, ch, left: HEAT_LEFT, top: HEAT_TOP };
    renderHeatLegend(h);
  }

  // Expert numbers along the top, layer numbers down the left, as many as fit unclipped.
  function heatAxes(ctx, h, width, cw, ch) {
    ctx.fillStyle = "#8b93a3";
    ctx.font = "11px system-ui";
    ctx.textAlign = "center";
    const everyE = Math.max(1, Math.ceil(28 / cw));
    state.heatLabels = { experts: [], layers: [] };
    for (let e = 0; e < width; e += everyE) {
      ctx.fillText(String(e), HEAT_LEFT + (e + 0.5) * cw, 12);
      state.heatLabels.experts.push(e);
    }
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const everyL = Math.max(1, Math.ceil(14 / ch));
    for (let r = 0; r < h.layers.length; r += everyL) {
      ctx.fillText(`L${h.layers[r]}`, HEAT_LEFT - 4, HEAT_TOP + (r + 0.5) * ch);
      state.heatLabels.layers.push(h.layers[r]);
    }
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    ctx.fillText("expert", 2, 12);
  }

  // Each worker's experts outlined in its colour: an edge of a cell is drawn where the
  // neighbouring cell has another owner (or none). A replicated expert gets a white dot.
  function outlineOwners(ctx, h, cw, ch) {
    const paths = h.workers.map(() => new Path2D());
    const dots = new Path2D();
    const owner = h.owner;
    for (let r = 0; r < owner.length; r++) {
      const row = owner[r];
      for (let e = 0; e < row.length; e++) {
        const o = row[e];
        if (o < 0) continue;
        const p = paths[o], x = e * cw, y = r * ch;
        if (e === 0 || row[e - 1] !== o) { p.moveTo(x + 0.5, y); p.lineTo(x + 0.5, y + ch); }
        if (e === row.length - 1 || row[e + 1] !== o) { p.moveTo(x + cw - 0.5, y); p.lineTo(x + cw - 0.5, y + ch); }
        if (r === 0 || owner[r - 1][e] !== o) { p.moveTo(x, y + 0.5); p.lineTo(x + cw, y + 0.5); }
        if (r === owner.length - 1 || owner[r + 1][e] !== o) { p.moveTo(x, y + ch - 0.5); p.lineTo(x + cw, y + ch - 0.5); }
        if (h.copies[r][e] > 1 && cw >= 4 && ch >= 4) dots.rect(x + cw / 2 - 1, y + ch / 2 - 1, 2, 2);
      }
    }
    ctx.lineWidth = cw >= 6 && ch >= 6 ? 2 : 1;
    paths.forEach((p, i) => { ctx.strokeStyle = WORKER_COLOURS[i % WORKER_COLOURS.length]; ctx.stroke(p); });
    ctx.fillStyle = "#ffffff";
    ctx.fill(dots);
  }

  function renderHeatLegend(h) {
    const s = h.summary;
    $("heat-info").textContent = `${s.tokens} (token, expert) pairs over ${h.layers.length} ` +
      `layers x ${Math.max(...h.experts)} experts; colour: log scale`;
    const ticks = [0];
    for (let t = 1; t <= h.max; t *= 10) ticks.push(t);
    if (h.max > 0 && ticks[ticks.length - 1] !== h.max) ticks.push(h.max);
    const logMax = Math.log1p(h.max) || 1;
    const stops = RAMP.map((c, i) => `rgb(${c.join(",")}) ${(100 * i / (RAMP.length - 1)).toFixed(0)}%`);
    $("heat-scale").innerHTML = `<span>tokens:</span>
      <span style="position:relative;display:inline-block;width:260px;height:26px">
        <span style="position:absolute;top:0;left:0;right:0;height:10px;background:linear-gradient(90deg,${stops.join(",")})"></span>
        ${ticks.map((t) => `<span style="position:absolute;top:12px;left:${(100 * Math.log1p(t) / logMax).toFixed(1)}%;transform:translateX(-50%)">${t}</span>`).join("")}
      </span>`;
    $("heat-workers").innerHTML = h.workers.map((name, i) => {
      const load = s.workers[name];
      return `<span><i style="background:${WORKER_COLOURS[i % WORKER_COLOURS.length]}"></i>` +
        `${esc(name)}${load ? `: ${load.tokens} tokens (${pct(load.share)})` : ""}</span>`;
    }).join("") + (s.measured_imbalance === null ? "" :
      `<span>measured imbalance (busiest / mean): ${num(s.measured_imbalance, 2)}</span>`);
    $("skew").innerHTML = "<tr><th>layer</th><th>tokens</th><th>hottest</th><th>max/mean</th>" +
      "<th>top share</th><th>unused</th></tr>" + Object.entries(s.layers).map(([layer, r]) =>
      `<tr><td>${layer}</td><td>${r.tokens}</td><td>${r.hottest}</td><td>${num(r.max_over_mean, 2)}</td>` +
      `<td>${pct(r.top_share)}</td><td>${r.unused}/${r.experts}</td></tr>`).join("");
    $("load").innerHTML = "<tr><th>worker</th><th>tokens computed</th><th>share</th></tr>" +
      Object.entries(s.workers).map(([name, w]) =>
        `<tr><td>${esc(name)}</td><td>${w.tokens}</td><td>${pct(w.share)}</td></tr>`).join("");
  }

  function heatCellAt(x, y) {
    const h = state.heat, g = state.heatGeometry;
    if (!h || !g) return null;
    const r = Math.floor((y - g.top) / g.ch), e = Math.floor((x - g.left) / g.cw);
    if (r < 0 || r >= h.layers.length || e < 0 || e >= h.counts[r].length) return null;
    return { layer: h.layers[r], expert: e, tokens: h.counts[r][e],
             owner: h.owner[r][e] >= 0 ? h.workers[h.owner[r][e]] : null, copies: h.copies[r][e] };
  }

  $("heat-map").addEventListener("mousemove", (event) => {
    const cell = heatCellAt(event.offsetX, event.offsetY);
    const tip = $("heat-tip");
    if (!cell) { tip.hidden = true; return; }
    tip.hidden = false;
    tip.textContent = `layer ${cell.layer}, expert ${cell.expert}: ${cell.tokens} tokens; ` +
      (cell.owner ? `on ${cell.owner}${cell.copies > 1 ? ` and ${cell.copies - 1} more` : ""}` : "no live owner");
    tip.style.left = `${event.offsetX + 14}px`;
    tip.style.top = `${event.offsetY + 10}px`;
  });
  $("heat-map").addEventListener("mouseleave", () => { $("heat-tip").hidden = true; });

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

  // -- chat -------------------------------------------------------------------------------

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = `message ${role}`;
    div.textContent = text;
    $("chat-log").appendChild(div);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return div;
  }

  async function sendChat(text) {
    state.chat.push({ role: "user", content: text });
    addMessage("user", text);
    const bubble = addMessage("assistant", "");
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    const stopping = new AbortController(); // Stop: the server drops a request whose client left
    state.stopChat = () => stopping.abort();
    const started = performance.now();
    let first = null, answer = "", usage = null, problem = null, pieces = 0, stopped = false;
    try {
      const reply = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers({ "Content-Type": "application/json" }),
        signal: stopping.signal,
        body: JSON.stringify({ model: state.model, messages: state.chat, stream: true,
                               max_tokens: Number($("chat-max").value) || 256,
                               temperature: Number($("chat-temperature").value),
                               stream_options: { include_usage: true } }),
      });
      if (!reply.ok) {
        const body = await reply.json();
        throw new Error(body.error ? body.error.message : String(reply.status));
      }
      const reader = reply.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) { problem = chunk.error.message; continue; }
            if (chunk.usage) usage = chunk.usage;
            const delta = chunk.choices && chunk.choices.length ? chunk.choices[0].delta.content : "";
            if (delta) {
              if (first === null) first = performance.now();
              answer += delta;
              pieces += 1;
              bubble.textContent = answer;
            }
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") stopped = true; else problem = e.message;
    }
    const finished = performance.now();
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    if (stopped) bubble.dataset.stopped = "true";
    if (problem) {
      bubble.classList.add("error");
      bubble.textContent = `${answer}${answer ? "\n" : ""}error: ${problem}`;
      state.chat.pop();
      return;
    }
    state.chat.push({ role: "assistant", content: answer });
    const tokens = usage ? usage.completion_tokens : null;
    const decodeTps = tokens > 1 && first !== null ? (tokens - 1) / ((finished - first) / 1000) : null;
    $("chat-figures").innerHTML = [
      [first === null ? "-" : `${(first - started).toFixed(0)} ms`, "time to first token"],
      [num(decodeTps), "tokens/s after the first"],
      [tokens === null ? "-" : String(tokens), "tokens"],
    ].map(([v, label]) => `<div><b>${esc(v)}</b><span>${esc(label)}</span></div>`).join("");
    bubble.dataset.pieces = String(pieces);
    bubble.dataset.done = "true";
  }

  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || $("chat-send").disabled) return;
    $("chat-input").value = "";
    sendChat(text);
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => { if (state.stopChat) state.stopChat(); });
  $("chat-clear").addEventListener("click", () => {
    state.chat = [];
    $("chat-log").innerHTML = "";
    $("chat-figures").innerHTML = "";
  });

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

  // For tests and the curious: what the heat map drew, cell by cell.
  window.shoalDashboard = {
    heatCell(layer, expert) {
      const h = state.heat, g = state.heatGeometry;
      const r = h ? h.layers.indexOf(layer) : -1;
      if (r < 0 || expert >= h.counts[r].length) return null;
      return { tokens: h.counts[r][expert], x: g.left + expert * g.cw + g.cw / 2,
               y: g.top + r * g.ch + g.ch / 2,
               owner: h.owner[r][expert] >= 0 ? h.workers[h.owner[r][expert]] : null,
               copies: h.copies[r][expert] };
    },
    heatCells() {
      return state.heat ? state.heat.counts.reduce((n, row) => n + row.length, 0) : 0;
    },
    heatLayers() { return state.heat ? state.heat.layers.slice() : []; },
    workerColours() { return WORKER_COLOURS.slice(); },
    heatLabels() { return state.heatLabels; },
    shortNumber: short,
  };

  checkKey().then((ok) => { if (ok) begin(); }).catch((e) => setStatus(`cannot reach the server: ${e.message}`, "bad"));
})();
