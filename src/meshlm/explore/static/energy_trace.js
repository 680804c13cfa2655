// The schedule of a trace (explore/energy.py, docs/energy.md "Scheduling in time"): the trace's prices (or
// carbon intensity) over time as stairs, the spans the run of the estimate would train in shaded, and
// their cost (or emissions) against running from the start. Chosen by the run's own code (core/facts).
"use strict";

async function runEnergy() {
  const svg = $("#energy-chart"), caption = $("#energy-caption");
  const seconds = Number($("#run-total").dataset.seconds || 0), steps = Number(input("training.steps").value);
  try {
    const res = await api("/api/energy_schedule", { trace: $("#energy-trace").value, steps, seconds,
      deadline: $("#energy-deadline").value.trim() });
    drawEnergy(svg, res);
    const unit = res.kind === "carbon" ? "gCO2e per kW" : "per kW";
    caption.textContent = `${res.spans.length} span(s) from ${res.from_now ? "now" : "the trace's start"}: ` +
      `${res.saves} ${fmtNum(res.cost)} vs ${fmtNum(res.cost_now)} running throughout (${unit}), ` +
      `${(100 * res.saving).toFixed(1)}% saved`;
    svg.dataset.spans = res.spans.length;
  } catch (e) {
    clear(svg);
    svg.dataset.spans = "";
    caption.textContent = e.message;
  }
}

// hours from the trace's start on x; the value on y as stairs; each chosen span a shaded band
function drawEnergy(svg, res) {
  const W = clear(svg), H = 200, L = 52, R = 10, T = 24, B = 34;
  const t0 = res.windows[0][0], t1 = res.windows[res.windows.length - 1][1];
  const vals = res.windows.map((w) => w[2]);
  let lo = Math.min(0, ...vals), hi = Math.max(...vals);
  if (hi === lo) hi = lo + 1;
  const X = (t) => L + (t - t0) / (t1 - t0) * (W - L - R), Y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  for (const [a, b, n] of res.spans) {
    el("title", {}, el("rect", { x: X(a), y: T, width: Math.max(X(b) - X(a), 1), height: H - T - B, fill: "#59a14f",
      "fill-opacity": 0.25, class: "span", "data-steps": n }, svg), `${n.toLocaleString()} steps`);
  }
  const yt = ticks(lo, hi, 5);
  for (const t of yt) {
    el("line", { x1: L, x2: W - R, y1: Y(t), y2: Y(t), stroke: "#eef0f2" }, svg);
    el("text", { x: L - 4, y: Y(t) + 4, "text-anchor": "end" }, svg, yt.fmt(t));
  }
  const hours = (t1 - t0) / 3600;
  for (const h of ticks(0, hours, 8).filter((h) => Number.isInteger(h))) {
    el("text", { x: X(t0 + 3600 * h), y: H - B + 14, "text-anchor": "middle" }, svg, String(h));
  }
  el("text", { x: (L + W) / 2, y: H - 4, "text-anchor": "middle" }, svg, "hours from the trace's start");
  const pts = res.windows.flatMap(([a, b, v]) => [`${X(a)},${Y(v)}`, `${X(b)},${Y(v)}`]).join(" ");
  el("polyline", { points: pts, fill: "none", stroke: COLORS[0], "stroke-width": 1.5, class: "line trace" }, svg);
  el("line", { x1: X(res.start), x2: X(res.start), y1: T, y2: H - B, stroke: "#9aa5b1", "stroke-dasharray": "3 3" }, svg);
  if (res.deadline < t1) el("line", { x1: X(res.deadline), x2: X(res.deadline), y1: T, y2: H - B, stroke: "#c62828",
    "stroke-dasharray": "4 2", class: "deadline" }, svg);
  el("rect", { x: L + 6, y: 4, width: 8, height: 8, fill: COLORS[0] }, svg);
  el("text", { x: L + 17, y: 12 }, svg, res.kind === "carbon" ? "gCO2e/kWh" : "price per kWh");
  el("rect", { x: L + 110, y: 4, width: 8, height: 8, fill: "#59a14f", "fill-opacity": 0.4 }, svg);
  el("text", { x: L + 121, y: 12 }, svg, "trains");
}

$("#energy-go").onclick = runEnergy;
