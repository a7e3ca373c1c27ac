// The speed section: its figures and two charts of the last minutes, drawn on canvases.

import { $, esc, num, state } from "./dashboard-common.js";

const AXIS_BOTTOM = 14; // px under a chart for its time labels
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

export function renderSpeed(body) {
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
export function short(x) {
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
  if (top > 0) { // nothing drawn yet: no scale (not "1e-9")
    ctx.fillText(short(top), 2, 11);
    ctx.fillText(short(top / 2), 2, plot - (plot - 14) / 2 + 4);
  }
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
  const highest = Math.max(0, ...values);
  const top = (highest || 1) * 1.1;
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
  axis(ctx, canvas, highest);
}

// Drawn into pixels, not as paths: a few hundred anti-aliased rectangles per part cost the
// browser's software raster far more than filling the columns here.
function drawStacked(canvas, samples) {
  const ctx = chartContext(canvas);
  const w = canvas.width, h = canvas.height - AXIS_BOTTOM;
  const totals = samples.map((s) => (s.breakdown ? STACKED.reduce(
    (sum, p) => sum + (s.breakdown[`${p}_us`] || 0), 0) : 0));
  const highest = Math.max(0, ...totals);
  if (!highest) { // every MoE layer ran in this process, or none ran yet: nothing to split
    axis(ctx, canvas, 0);
    ctx.fillStyle = "#8b93a3";
    ctx.font = "12px system-ui";
    ctx.textAlign = "center";
    ctx.fillText("no MoE layer call sent to a worker in this window", w / 2, h / 2 - 6);
    ctx.fillText("(layers whose experts are all here run in process, as mlx-lm runs them)",
      w / 2, h / 2 + 10);
    ctx.textAlign = "left";
    return;
  }
  const top = highest * 1.1;
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
  axis(ctx, canvas, highest);
}
