// The heat section: one cell per (layer, expert) on a log colour scale, each worker's
// experts outlined in its colour, the axes, the legend and the per-layer skew.

import { $, esc, num, pct, state } from "./dashboard-common.js";

// Outlines over the heat ramp (black, purples, reds, oranges, yellow): hues it has not,
// far apart from each other, the first ones the most different.
export const WORKER_COLOURS = ["#00e5ff", "#76ff03", "#ffffff", "#2962ff", "#ff4dff", "#9e9e9e",
                        "#1de9b6", "#b388ff", "#00838f", "#33691e"];
const HEAT_LEFT = 44, HEAT_TOP = 18; // room for the layer and expert labels
// inferno-like stops, dark (cold) to light (hot)
const RAMP = [[0, 0, 4], [40, 11, 84], [101, 21, 110], [159, 42, 99], [212, 72, 66],
              [245, 125, 21], [250, 193, 39], [252, 255, 164]];
const COLOURS = Array.from({ length: 256 }, (_, i) => ramp(i / 255).map(Math.round));

function ramp(v) {
  const x = Math.min(1, Math.max(0, v)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(x));
  const f = x - i;
  const a = RAMP[i], b = RAMP[i + 1];
  return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
}

export function renderHeat(h) {
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

// For tests and the curious: what the heat map drew, cell by cell.
export const heatView = {
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
  heatLabels() { return state.heatLabels; },
};
