// The dashboard's shared pieces: the page's state, small formatters, and the JSON fetch
// with the API key (a refused key hands over to the page's key form through `hooks`).

export const KEY = "shoal-api-key"; // sessionStorage: kept for this tab, never put in a URL
export const $ = (id) => document.getElementById(id);
export const state = {
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
export const hooks = { refused: () => {} };

export class Refused extends Error {}

export function esc(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

export function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}

export const pct = (x) => (x === null || x === undefined ? "-" : `${(100 * x).toFixed(1)}%`);
export const num = (x, digits = 1) => (x === null || x === undefined ? "-" : x.toFixed(digits));

export function ago(wall) {
  if (!wall) return "";
  const s = Math.max(0, Date.now() / 1000 - wall);
  const clock = new Date(wall * 1000).toLocaleTimeString();
  if (s < 90) return `since ${clock} (${Math.round(s)} s)`;
  if (s < 5400) return `since ${clock} (${Math.round(s / 60)} min)`;
  return `since ${clock} (${(s / 3600).toFixed(1)} h)`;
}

export function uptime(wall) {
  const s = Math.max(0, Date.now() / 1000 - wall);
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

export function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

export async function getJSON(path) {
  const reply = await fetch(path, { headers: headers(), cache: "no-store" });
  if (reply.status === 401) { hooks.refused("the server refused this key"); throw new Refused(); }
  const body = await reply.json();
  if (!reply.ok) throw new Error(body.error ? body.error.message : `${path}: ${reply.status}`);
  return body;
}

// Each update's script time goes to the browser's performance timeline as a measure.
export function timed(name, draw) {
  const start = performance.now();
  try { draw(); } finally {
    performance.measure(`shoal:${name}`, { start, end: performance.now() });
  }
}

export function setStatus(text, kind) {
  const s = $("status");
  s.textContent = text;
  s.className = `pill ${kind || ""}`;
}
