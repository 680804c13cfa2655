// The run's course (explore/course.py): the learning rate and, under a ramp, the global batch over the
// steps, sampled by the server from the trainer's own lr_at and BatchRamp; and the run's total time.
"use strict";

const CORNER_NAMES = { warmup_end: "peak LR (warmup's end) at", decay_start: "decay from", ramp_end: "full batch from" };

// plan/cost/estimate.py `describe_run`, as `meshlm estimate` prints it
function describeRun(run) {
  if (!run) return "";
  if (run.skipped) return `run: ${run.skipped}`;
  const hours = Number((run.seconds / 3600).toPrecision(3)).toLocaleString();
  let line = `run: <b>${run.steps.toLocaleString()}</b> steps, <b>${hours} h</b>`;
  if (run.ramp_steps) line += ` (ramp: first ${run.ramp_steps.toLocaleString()} steps at smaller batches, ` +
    `${run.ramp_extra >= 0 ? "+" : ""}${(100 * run.ramp_extra).toFixed(1)}%)`;
  return line;
}

// A piecewise-constant series drawn as steps: each value holds until the next sample.
function stairs(xs, ys) {
  const out = [];
  xs.forEach((x, i) => { if (i) out.push([x, ys[i - 1]]); out.push([x, ys[i]]); });
  return out;
}

function markCorners(svg, corners, xs) {  // dashed lines where the curves bend (titles name them)
  const lines = svg.querySelectorAll("polyline");
  if (!lines.length || xs.length < 2) return;
  const box = lines[0].getBBox(), lo = xs[0], hi = xs[xs.length - 1];
  for (const [k, step] of Object.entries(corners)) {
    const x = box.x + (step - lo) / (hi - lo || 1) * box.width;
    el("title", {}, el("line", { x1: x, x2: x, y1: 20, y2: 166, stroke: "#9aa5b1", "stroke-dasharray": "3 3",
      class: "corner", "data-corner": k, "data-step": step }, svg), `${CORNER_NAMES[k]} step ${step.toLocaleString()}`);
  }
}

function renderCourse(res) {
  const c = res.course, run = $("#run-total");
  run.innerHTML = describeRun(res.run);
  run.dataset.seconds = res.run && !res.run.skipped ? res.run.seconds : "";
  const lr = $("#lr-chart"), batch = $("#batch-chart");
  $("#course-card").classList.toggle("two", !!c.batch);  // before drawing: the charts take their widths
  lineChart(lr, [{ name: "learning rate", cls: "lr", points: c.step.map((s, i) => [s, c.lr[i]]) }], { ymin: 0 });
  markCorners(lr, c.corners, c.step);
  lr.dataset.points = c.step.length;
  batch.style.display = c.batch ? "" : "none";
  if (c.batch) {
    lineChart(batch, [{ name: "global batch (sequences)", cls: "batch", points: stairs(c.step, c.batch) }], { ymin: 0 });
    markCorners(batch, { ramp_end: c.corners.ramp_end }, c.step);
  } else clear(batch);
  const parts = Object.entries(c.corners).map(([k, s]) => `${CORNER_NAMES[k]} step ${s.toLocaleString()}`);
  $("#course-caption").textContent = parts.join(" · ") + (c.batch ? "" : (parts.length ? " · " : "") + "fixed batch");
}
