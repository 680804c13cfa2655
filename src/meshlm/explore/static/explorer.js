// The strategy explorer: the estimate of the form's layout, and the plan's best layouts.
"use strict";

let lastEstimate = null, seqEst = 0, seqPlan = 0;
const timers = {};
const MEM_LABELS = { cpu_optim: "host (offloaded optimizer)", disk_optim: "disk (nvme offload files)" };
// the search's inputs: not the layout it chooses, nor the schedule (no layout's price depends on it)
const PLAN_KEYS = (k) => !k.startsWith("parallel.") && k !== "training.micro_batch" && k !== "training.ac" &&
  !(k in OPTIONS.course_defaults);

async function api(path, body) {
  const r = await fetch(path, body === undefined ? {} : { method: "POST", body: JSON.stringify(body),
    headers: { "Content-Type": "application/json" } });
  const data = await r.json();
  if (!r.ok) throw Object.assign(new Error(data.error), { key: data.key, status: r.status });
  return data;
}

function debounce(name, ms, fn) { clearTimeout(timers[name]); timers[name] = setTimeout(fn, ms); }

function invalidate(message, key, status) {
  showError(message, key);
  $("#outputs").classList.add("stale");
  $("#export").disabled = true;  // the shown numbers and their TOML belong to the last possible layout
  $("#status").textContent = status;
}

async function update() {
  const my = ++seqEst, bad = invalidInput();
  if (bad) { invalidate(bad[1], bad[0], "invalid input"); return false; }
  $("#status").textContent = "estimating…";
  try {
    const body = collect(), res = await api("/api/estimate", body);
    if (my !== seqEst) return false;
    showError(null);
    $("#outputs").classList.remove("stale");
    $("#export").disabled = false;
    lastEstimate = res;
    render(res, body);
    $("#status").textContent = "";
    return true;
  } catch (e) {
    if (my === seqEst) invalidate(e.message, e.key, e.status === 400 ? "impossible layout" : "error");
    return false;
  }
}

function renderMemory(r, body) {
  const pg = r.per_gpu, d = r.memory_detail;
  const parts = ["params", "grads", "optim", "activations", "buffers"].map((k) => ({ name: k, value: pg[k] }));
  stackedBar($("#mem-bar"), parts, { limit: r.usable_bytes, fmt: fmtBytes, bad: r.fits === false,
    limitLabel: `usable ${fmtBytes(r.usable_bytes)} of ${fmtBytes(r.hbm_bytes)}` });
  const t = $("#mem-table");
  t.innerHTML = "<tr><th></th><th>per GPU</th></tr>" + ["params", "grads", "optim", "activations", "buffers", "total", "cpu_optim", "disk_optim"]
    .map((k) => `<tr><td>${MEM_LABELS[k] || k}</td><td id="mem-${k}" data-bytes="${pg[k]}">${fmtBytes(pg[k])}</td></tr>`).join("");
  Object.assign(t.dataset, { model: body["model.preset"], gpus: body.gpus, tp: body["parallel.tp"] || 1 });
  $("#mem-caption").innerHTML = `worst rank: ${d.stage} stage, ${d.layers} layers, ${fmtNum(d.inflight_microbatches)} micro-batches in flight — ` +
    (r.fits ? `<span class="fit">fits</span>` : `<span class="nofit">does not fit</span>`);
}

function renderTime(r, res) {
  const tm = r.time, h = $("#headline");
  h.dataset.step = r.step_s;
  h.innerHTML = `<b>${fmtNum(r.step_s, 3)} s</b> per step · <b>${fmtNum(r.tokens_per_s_per_gpu, 0)}</b> tokens/s per GPU · ` +
    `MFU <b id="mfu">${(100 * r.mfu).toFixed(1)}%</b> · ${res.derived.global_batch} sequences × ${res.derived.microbatches} micro-batches per rank`;
  $("#time-caption").textContent = `bubble ${(100 * tm.bubble_fraction).toFixed(1)}% (${tm.bubble_source})` +
    (tm.offload_io_s ? ` · nvme offload disk I/O ${fmtNum(tm.offload_io_s, 3)} s of the optimizer's ${fmtNum(tm.offload_s, 3)} s` : "");
  $("#time-bar").style.display = "";
  stackedBar($("#time-bar"), [
    { name: "forward", value: tm.forward_s }, { name: "backward", value: tm.backward_s }, { name: "recompute", value: tm.recompute_s },
    { name: "exposed comm", value: tm.exposed_comm_microbatch_s + tm.exposed_comm_step_s },
    { name: "compute beside comm", value: tm.overlap_slowdown_s }, { name: "bubble", value: tm.bubble_s },
    { name: "optimizer", value: tm.optimizer_s + tm.offload_s }], { fmt: (s) => fmtNum(s, 3) + " s" });
  // the per-operation model's breakdown of the compute (plan/cost/ops.py); absent with a flat --efficiency
  const ops = r.ops || {};
  $("#ops-table").innerHTML = r.ops ? "<tr><th>compute by operation</th><th>s per step</th></tr>" +
    ["gemm_s", "attention_s", "elementwise_s", "launch_s", "grad_accum_s", "head_s", "loss_s", "recompute_s"]
      .map((k) => `<tr><td>${k.replace("_s", "").replace("_", " ")}</td><td id="ops-${k}">${fmtNum(ops[k], 3)}</td></tr>`).join("") : "";
}

function renderComm(r) {
  $("#comm-table").innerHTML = "<tr><th>group</th><th>collective</th><th>link</th><th>ranks</th><th>GB/step</th><th>time s</th><th>exposed s</th><th>hidden</th><th>behind</th></tr>" +
    (r.comm.length ? r.comm.map((c) => `<tr><td>${c.group}</td><td>${c.kind}</td><td>${c.link}</td><td>${c.group_size}</td><td>${(c.bytes / 1e9).toFixed(2)}</td>` +
      `<td>${fmtNum(c.seconds, 3)}</td><td>${fmtNum(c.exposed_s, 3)}</td><td>${c.seconds ? (100 * (1 - c.exposed_s / c.seconds)).toFixed(0) + "%" : "-"}</td><td>${c.overlaps_with}</td></tr>`).join("")
      : "<tr><td colspan=9>no communication: one GPU</td></tr>");
}

function render(res, body) {
  renderCourse(res);
  if (res.mixed) { renderMixed(res, body); return; }
  delete $("#mem-table").dataset.mixed;
  if (isMixed()) setValue("gpus", res.derived.gpus);  // a one-type cluster (h100:16) is the one-type estimate
  const r = res.estimate;
  renderMemory(r, body);
  $("#dp-derived").textContent = `= ${res.derived.dp}`;
  if (r.step_s === undefined) { $("#headline").textContent = "no time model without a peak FLOP/s"; return; }
  renderTime(r, res);
  renderComm(r);
  drawPipeline($("#pipe"), $("#pipe-caption"), res.pipeline, "pp = 1: no pipeline");
}

// ------------------------------------------------------------------------------------- plan
function planCaption(res) {
  const c = res.counts, n = (k) => (c[k] || 0).toLocaleString();
  // fit + out of memory + invalid = searched (plan/search/ranked.py counts each candidate once); dominated is part of fit
  const fit = ((c.fit || 0) - (c.dominated || 0)).toLocaleString();
  return `meshlm plan: <span data-count="candidates">${n("candidates")}</span> layouts searched in ${res.elapsed_s.toFixed(2)} s: <span data-count="fit">${fit}</span> fit, ` +
    `<span data-count="dominated">${n("dominated")}</span> fit but dominated by a faster AC/offload variant, ` +
    `<span data-count="oom">${n("oom")}</span> out of memory, <span data-count="invalid">${n("invalid")}</span> invalid` +
    (res.ranked.length ? " — click a row to load it" : " — no layout fits");
}

function planRow(r, i) {
  const L = r.layout, sched = L.pp === 1 ? "-" : L.pp_schedule + (L.pp_virtual > 1 ? " v" + L.pp_virtual : "");
  const zero = L.zero + (L.zero && L.zero_group !== L.dp ? " g" + L.zero_group : "");
  return `<tr data-i="${i}" data-step="${r.step_s}" data-bytes="${r.per_gpu_total}"><td>${i + 1}</td><td>${fmtNum(r.tokens_per_s_per_gpu, 0)}</td>` +
    `<td>${(100 * r.mfu).toFixed(1)}%</td><td>${fmtNum(r.step_s, 2)}</td><td>${(r.per_gpu_total / 2 ** 30).toFixed(1)}</td>` +
    `<td>${L.tp}${L.sp ? "+sp" : ""}</td><td>${L.pp}</td><td>${sched}</td><td>${L.cp}</td><td>${L.dp}</td>` +
    `<td>${L.ep}</td><td>${zero}</td><td>${L.micro_batch}×${L.microbatches}</td><td>${L.ac}</td><td>${L.offload}</td>` +
    `<td class="energy">${r.j_per_token == null ? "-" : r.j_per_token.toFixed(3)}</td></tr>`;
}

function planStale(message) {
  $("#plan-card").classList.add("stale");  // the rows below belong to earlier inputs
  $("#plan-caption").textContent = message;
}

async function runPlan() {
  const my = ++seqPlan, bad = invalidInput();
  if (bad && PLAN_KEYS(bad[0])) { planStale(bad[1]); return; }
  const body = Object.fromEntries(Object.entries(collect()).filter(([k]) => PLAN_KEYS(k)));
  $("#plan-caption").textContent = "searching…";
  try {
    const res = await api("/api/plan", body);
    if (my !== seqPlan) return;
    $("#plan-card").classList.remove("stale");
    const t = $("#plan-table");
    $("#plan-compare").innerHTML = "";
    drawPareto($("#pareto-chart"), $("#pareto-caption"), res, (i) => loadRow(res.ranked[i], i));  // energy.js
    if (res.mixed) { renderMixedPlan(res, body); return; }
    $("#plan-caption").innerHTML = planCaption(res);
    Object.assign(t.dataset, { model: body["model.preset"], gpus: body.gpus, loaded: "" });
    t.innerHTML = "<thead><tr><th>#</th><th>tok/s/GPU</th><th>MFU</th><th>step s</th><th>GiB</th><th>tp</th><th>pp</th><th>schedule</th><th>cp</th><th>dp</th><th>ep</th><th>zero</th><th>mb×m</th><th>ac</th><th>offload</th><th title='predicted joules per token at the wall (docs/energy.md)'>J/token</th></tr></thead><tbody>" +
      (res.ranked.map(planRow).join("") || "<tr><td colspan=16>no layout fits</td></tr>") + "</tbody>";
    for (const tr of t.querySelectorAll("tbody tr[data-i]")) tr.onclick = () => loadRow(res.ranked[+tr.dataset.i], +tr.dataset.i);
  } catch (e) {
    if (my === seqPlan) planStale(e.message);
  }
}

async function loadRow(row, i) {  // every key the planner set, pp_layers included (api.layout_inputs)
  const t = $("#plan-table");
  t.dataset.loaded = "";
  setLayout(row.inputs);
  lastChanged = null;
  showNote("");
  if (await update()) t.dataset.loaded = i;
}

function exportConfig() {
  if (!lastEstimate) return;
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([lastEstimate.toml], { type: "application/toml" }));
  a.download = `meshlm-${input("model.preset").value}-${input("gpus").value}gpus.toml`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function applyExample(ex) {
  setLayout({});
  input("cluster").value = "";
  if (ex.inputs["model.preset"]) { setValue("model.preset", ex.inputs["model.preset"]); setPreset(ex.inputs["model.preset"]); }
  for (const [k, x] of Object.entries(ex.inputs)) setValue(k, x);
  syncCluster();
  lastChanged = null;
  showNote(ex.note);
  update();
  runPlan();
}
