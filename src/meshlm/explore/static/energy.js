// The plan's layouts in time and energy: each row's predicted step time against its J/token, the
// time-energy Pareto front (api.run_plan's `pareto`: no other row is as fast and as frugal) joined by a line.
"use strict";

function drawPareto(svg, caption, res, onPick) {
  const W = clear(svg), H = 220, L = 58, R = 12, T = 14, B = 36;
  svg.style.height = H + "px";
  const rows = (res.mixed ? [] : res.ranked).map((r, i) => ({ i, x: r.step_s, y: r.j_per_token }))
    .filter((p) => p.y !== null && p.y !== undefined);
  if (!rows.length) {
    caption.textContent = res.mixed ? "(a mixed cluster is ranked by time only)" : "(no layout priced)";
    el("text", { x: L, y: H / 2 }, svg, "no energy to draw");
    return;
  }
  const front = new Set(res.pareto || []);
  const pad = (lo, hi) => (hi > lo ? [lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)] : [lo * 0.99, hi * 1.01 || 1]);
  const [xlo, xhi] = pad(Math.min(...rows.map((p) => p.x)), Math.max(...rows.map((p) => p.x)));
  const [ylo, yhi] = pad(Math.min(...rows.map((p) => p.y)), Math.max(...rows.map((p) => p.y)));
  const X = (x) => L + (x - xlo) / (xhi - xlo) * (W - L - R), Y = (y) => T + (1 - (y - ylo) / (yhi - ylo)) * (H - T - B);
  const yt = ticks(ylo, yhi, 5), xt = ticks(xlo, xhi, 6);
  for (const t of yt) {
    el("line", { x1: L, x2: W - R, y1: Y(t), y2: Y(t), stroke: "#eef0f2" }, svg);
    el("text", { x: L - 4, y: Y(t) + 4, "text-anchor": "end" }, svg, yt.fmt(t));
  }
  for (const t of xt) el("text", { x: X(t), y: H - B + 14, "text-anchor": "middle" }, svg, xt.fmt(t));
  el("text", { x: (L + W) / 2, y: H - 4, "text-anchor": "middle" }, svg, "step time, s");
  el("text", { x: 12, y: T + (H - T - B) / 2, transform: `rotate(-90 12 ${T + (H - T - B) / 2})`, "text-anchor": "middle" },
    svg, "J/token");
  const onFront = rows.filter((p) => front.has(p.i)).sort((a, b) => a.x - b.x);
  if (onFront.length > 1) {
    el("polyline", { points: onFront.map((p) => `${X(p.x)},${Y(p.y)}`).join(" "), fill: "none", stroke: COLORS[3],
      "stroke-width": 1.5, class: "front" }, svg);
  }
  for (const p of rows) {
    const on = front.has(p.i);
    const c = el("circle", { cx: X(p.x), cy: Y(p.y), r: on ? 5 : 3.5, fill: on ? COLORS[3] : COLORS[0],
      "fill-opacity": on ? 1 : 0.6, class: on ? "dot front" : "dot", "data-i": p.i }, svg);
    el("title", {}, c, `#${p.i + 1}: ${fmtNum(p.x, 2)} s per step, ${p.y.toFixed(3)} J/token${on ? " (on the front)" : ""}`);
    c.style.cursor = "pointer";
    c.onclick = () => onPick(p.i);
  }
  caption.textContent = `${rows.length} layouts, ${onFront.length} on the time-energy front (red): ` +
    "none is matched or beaten on both axes by another row; click a dot to load it";
}
