// trajstore viewer: the run page's plots (uPlot), from the JSON the page carries.
"use strict";

const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#7f7f7f"];

function plot(element, data, key, label) {
  if (!element || data.x.length === 0) {
    if (element) element.innerHTML = '<p class="empty">No sessions yet.</p>';
    return;
  }
  const width = Math.max(320, element.clientWidth || 480);
  const series = [{ label: "time", value: (u, v) => (v == null ? "" : new Date(v * 1000).toISOString().replace("T", " ").slice(0, 19)) }];
  data.series.forEach((s, i) => series.push({
    label: s.label, stroke: COLOURS[i % COLOURS.length], width: 0,
    paths: () => null, points: { show: true, size: 6, fill: COLOURS[i % COLOURS.length] },
  }));
  const values = [data.x, ...data.series.map((s) => s[key])];
  new uPlot({ width, height: 220, series, axes: [{}, { label }], scales: { x: { time: true } } },
            values, element);
}

document.addEventListener("DOMContentLoaded", () => {
  const carrier = document.getElementById("plot-data");
  if (!carrier || !window.uPlot) return;
  const data = JSON.parse(carrier.textContent);
  plot(document.getElementById("plot-reward"), data, "reward", "reward");
  plot(document.getElementById("plot-tokens"), data, "tokens", "tokens");
});
