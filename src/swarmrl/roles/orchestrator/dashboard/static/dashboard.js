// Curves of the run overview: uPlot (vendored) over /ui/api/steps, refreshed every few seconds.
"use strict";

const CHARTS = [
  { id: "chart-reward", title: "reward and accuracy", keys: ["reward_mean", "accuracy"] },
  { id: "chart-loss", title: "loss, KL, clip fraction", keys: ["loss", "kl", "clip_fraction"] },
  { id: "chart-time", title: "step time (s)", keys: ["rollout_s", "update_s"] },
  { id: "chart-staleness", title: "staleness (versions): mean, max", keys: ["staleness", "staleness_max"] },
  { id: "chart-mismatch", title: "off-policy mismatch: KL, corrected fraction", keys: ["mismatch_kl", "corrected_fraction"] },
];
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
const plots = {};
window.swarmrlPlots = plots; // read by the browser tests

function columns(rows, keys) {
  const xs = rows.map((r) => r.step);
  return [xs, ...keys.map((k) => rows.map((r) => (r[k] === null || r[k] === undefined ? null : r[k])))];
}

function draw(rows) {
  for (const chart of CHARTS) {
    const el = document.getElementById(chart.id);
    if (!el) continue;
    const data = columns(rows, chart.keys);
    if (plots[chart.id]) {
      plots[chart.id].setData(data);
      continue;
    }
    const series = [{ label: "step" }].concat(
      chart.keys.map((k, i) => ({ label: k, stroke: COLOURS[i], points: { show: true, size: 5 } }))
    );
    plots[chart.id] = new uPlot({ title: chart.title, width: 560, height: 260, series, scales: { x: { time: false } } }, data, el);
  }
  const count = document.getElementById("step-count");
  if (count) count.textContent = String(rows.length);
}

async function refresh() {
  const reply = await fetch("api/steps", { cache: "no-store" });
  if (reply.ok) draw(await reply.json());
}

document.addEventListener("DOMContentLoaded", () => {
  const initial = document.getElementById("steps-data");
  draw(initial ? JSON.parse(initial.textContent) : []);
  setInterval(() => refresh().catch(() => {}), 3000);
});
