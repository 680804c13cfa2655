// Small SVG charts for the explorer: a stacked bar, a line chart and a pipeline timeline.
"use strict";

const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"];
const KIND_COLORS = { F: "#4e79a7", B: "#59a14f", I: "#8cd17d", W: "#b6992d" };

function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

function clear(svg) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  return svg.getBoundingClientRect().width || 600;
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "-";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return (i ? b.toFixed(2) : b.toFixed(0)) + " " + u[i];
}

function fmtNum(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  const a = Math.abs(x);
  if (a === 0) return "0";
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return x.toExponential(2);
  return x.toFixed(digits === undefined ? (a >= 100 ? 0 : a >= 1 ? 2 : 4) : digits);
}

// parts: [{name, value}], opts: {limit, limitLabel, fmt, bad}. Draws one horizontal stacked bar.
function stackedBar(svg, parts, opts) {
  const W = clear(svg), H = 72, x0 = 4, y0 = 8, h = 22;
  const total = parts.reduce((s, p) => s + p.value, 0);
  const max = Math.max(total, opts.limit || 0) * 1.02 || 1;
  const scale = (W - 2 * x0) / max;
  let x = x0;
  parts.forEach((p, i) => {
    const w = p.value * scale;
    const r = el("rect", { x, y: y0, width: Math.max(w, 0), height: h, fill: COLORS[i % COLORS.length],
      class: "seg", "data-name": p.name, "data-value": p.value }, svg);
    el("title", {}, r, `${p.name}: ${opts.fmt(p.value)}`);
    x += w;
  });
  if (opts.bad) el("rect", { x: x0, y: y0, width: total * scale, height: h, fill: "none", stroke: "#c62828", "stroke-width": 3 }, svg);
  if (opts.limit) {
    const lx = x0 + opts.limit * scale;
    el("line", { x1: lx, x2: lx, y1: 2, y2: y0 + h + 6, stroke: "#111", "stroke-width": 2, "stroke-dasharray": "4 2" }, svg);
    const t = el("text", { x: lx - 3, y: y0 + h + 16, "text-anchor": "end", class: "limit" }, svg, opts.limitLabel || "");
    // far over the limit the line sits near the left edge: the label goes right of it, inside the chart
    if (lx - 3 - t.getComputedTextLength() < 0) { t.setAttribute("x", lx + 3); t.setAttribute("text-anchor", "start"); }
  }
  let lx = x0;
  parts.forEach((p, i) => {  // legend
    if (!p.value) return;
    el("rect", { x: lx, y: H - 10, width: 8, height: 8, fill: COLORS[i % COLORS.length] }, svg);
    const t = el("text", { x: lx + 11, y: H - 2 }, svg, p.name);
    lx += 16 + (t.getComputedTextLength ? t.getComputedTextLength() : p.name.length * 6);
  });
}

function ticks(lo, hi, n) {
  if (hi <= lo) hi = lo + 1;
  const step0 = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const out = [], digits = Math.max(0, -Math.floor(Math.log10(step)));
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9 * step; t += step) out.push(t);
  out.fmt = (v) => (Math.abs(v) >= 1e6 ? v.toExponential(1) : v.toFixed(digits));  // as precise as the step
  return out;
}

// series: [{name, cls, points: [[x, y], ...], dots}]; opts: {yfmt, ymin}
function lineChart(svg, series, opts) {
  const W = clear(svg), H = 200, L = 52, R = 10, T = 24, B = 34;
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) { el("text", { x: L, y: H / 2 }, svg, "no data yet"); return; }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const xlo = Math.min(...xs), xhi = Math.max(...xs) === xlo ? xlo + 1 : Math.max(...xs);
  let ylo = opts && opts.ymin !== undefined ? opts.ymin : Math.min(...ys), yhi = Math.max(...ys);
  if (yhi === ylo) { yhi += Math.abs(yhi) * 0.1 || 1; ylo -= Math.abs(ylo) * 0.1; }
  const X = (x) => L + (x - xlo) / (xhi - xlo) * (W - L - R), Y = (y) => T + (1 - (y - ylo) / (yhi - ylo)) * (H - T - B);
  const yt = ticks(ylo, yhi, 5), yfmt = (opts && opts.yfmt) || yt.fmt;
  for (const t of yt) {
    el("line", { x1: L, x2: W - R, y1: Y(t), y2: Y(t), stroke: "#eef0f2" }, svg);
    el("text", { x: L - 4, y: Y(t) + 4, "text-anchor": "end" }, svg, yfmt(t));
  }
  for (const t of ticks(xlo, xhi, 6).filter((t) => Number.isInteger(t))) {
    el("text", { x: X(t), y: H - B + 14, "text-anchor": "middle" }, svg, String(t));
  }
  el("text", { x: (L + W) / 2, y: H - 4, "text-anchor": "middle" }, svg, "step");
  let lx = L + 6;
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    if (!s.points.length) return;
    el("polyline", { points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" "), fill: "none", stroke: color,
      "stroke-width": 1.5, class: "line " + s.cls }, svg);
    if (s.dots) for (const p of s.points) {
      el("title", {}, el("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: color, class: s.cls }, svg),
        `step ${p[0]}: ${fmtNum(p[1])}`);
    }
    el("rect", { x: lx, y: 4, width: 8, height: 8, fill: color }, svg);
    el("text", { x: lx + 11, y: 12 }, svg, s.name);
    lx += 20 + s.name.length * 6;
  });
}

// A simulated or measured pipeline timeline with its caption, or `none` (the reason there is none).
function drawPipeline(svg, caption, tl, none) {
  if (!tl || tl.skipped) { clear(svg); svg.style.height = "10px"; caption.textContent = tl ? tl.skipped : none; return; }
  timeline(svg, tl);
  caption.textContent = `${tl.name}, ${tl.p} ranks × ${tl.m} micro-batches × ${tl.v} chunks (${tl.source}): ` +
    `${(100 * tl.bubble).toFixed(1)}% of the ranks' time idle`;
}

// tl: {p, rows: [[[start, end, kind, mb, chunk], ...] per rank], makespan}: one lane per rank.
function timeline(svg, tl) {
  const W = clear(svg), L = 50, R = 8, lane = 18, H = tl.p * lane + 22;
  svg.style.height = H + "px";
  const X = (t) => L + t / (tl.makespan || 1) * (W - L - R);
  tl.rows.forEach((row, r) => {
    el("text", { x: 2, y: r * lane + 13 }, svg, "rank " + r);
    for (const [s, e, kind, mb, chunk] of row) {
      const rect = el("rect", { x: X(s), y: r * lane + 2, width: Math.max(X(e) - X(s) - 0.5, 0.5), height: lane - 4,
        fill: KIND_COLORS[kind] || "#999", "fill-opacity": chunk % 2 ? 0.6 : 1, class: "act " + kind }, svg);
      el("title", {}, rect, `${kind} mb ${mb} chunk ${chunk}: ${fmtNum(e - s)}`);
      if (X(e) - X(s) > 14) el("text", { x: X(s) + 2, y: r * lane + 13, fill: "#fff" }, svg, String(mb));
    }
  });
  let lx = L;
  for (const [k, c] of Object.entries(KIND_COLORS)) {
    el("rect", { x: lx, y: H - 12, width: 8, height: 8, fill: c }, svg);
    el("text", { x: lx + 11, y: H - 4 }, svg, { F: "forward", B: "backward", I: "input grad", W: "weight grad" }[k]);
    lx += 90;
  }
}
