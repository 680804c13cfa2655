// meshlm explore: the page. Inputs are named by the API's keys (config keys like "parallel.tp", or
// estimate/plan flags like "gpus"), so a request is just the form, and an error's key names its input.
"use strict";

const $ = (s) => document.querySelector(s);
const form = $("#inputs");
const LAYOUT_DEFAULTS = { "parallel.dp": -1, "parallel.zero": 0, "parallel.zero_group": 0, "parallel.tp": 1,
  "parallel.sp": false, "parallel.pp": 1, "parallel.pp_schedule": "1f1b", "parallel.pp_virtual": 1, "parallel.cp": 1,
  "parallel.cp_impl": "ring", "parallel.ep": 1, "parallel.offload": "none", "parallel.quantize_weights": false, "parallel.hpz_group": 0,
  "parallel.quantize_grads": false, "training.micro_batch": 1, "training.ac": "none" };
const SHAPE = ["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings"];
let OPTIONS = null, lastChanged = null, lastEstimate = null, seqEst = 0, seqPlan = 0, timers = {};

async function api(path, body) {
  const r = await fetch(path, body === undefined ? {} : { method: "POST", body: JSON.stringify(body),
    headers: { "Content-Type": "application/json" } });
  const data = await r.json();
  if (!r.ok) throw Object.assign(new Error(data.error), { key: data.key, status: r.status });
  return data;
}

function debounce(name, ms, fn) { clearTimeout(timers[name]); timers[name] = setTimeout(fn, ms); }
const input = (name) => form.elements.namedItem(name);

// ------------------------------------------------------------------------------------- inputs
function fillSelect(name, values, labels) {
  const s = input(name);
  s.innerHTML = "";
  values.forEach((v, i) => { const o = document.createElement("option"); o.value = v; o.textContent = labels ? labels[i] : v; s.appendChild(o); });
}

function setValue(name, v) {
  const e = input(name);
  if (!e) return;
  if (e.type === "checkbox") e.checked = !!v; else e.value = v;
}

function setPreset(name) {  // the shape fields show the preset; only edits that differ are sent
  const a = OPTIONS.presets[name];
  for (const k of SHAPE) { setValue("model." + k, a[k]); input("model." + k).dataset.preset = String(a[k]); }
  setValue("data.seq_len", a.seq_len);  // the pretraining context (llama3-*: 8192, not the 131072 RoPE reaches)
}

function collect() {
  const body = {};
  for (const e of form.elements) {
    if (!e.name) continue;
    let v = e.type === "checkbox" ? e.checked : e.value;
    if (e.type !== "checkbox" && v === "") continue;
    if (e.type === "number" || e.name === "parallel.zero") v = Number(v);
    if (e.dataset.preset !== undefined && String(v) === e.dataset.preset) continue;
    body[e.name] = v;
  }
  return body;
}

function showError(message, key) {
  for (const e of form.querySelectorAll(".err")) e.textContent = "";
  for (const e of form.querySelectorAll(".bad")) e.classList.remove("bad");
  if (!message) return;
  // next to the input that causes it: the key's input, or the one just changed if the message names it
  let target = key && input(key);
  const short = lastChanged && lastChanged.split(".").pop();
  if (lastChanged && lastChanged !== key && short && new RegExp(`\\b${short}\\b`).test(message.replace(/×/g, " "))) target = input(lastChanged);
  if (!target || !target.closest("label")) { $("#form-error").textContent = message; return; }
  target.classList.add("bad");
  let span = target.closest("label").querySelector(".err");
  if (!span) { span = document.createElement("span"); span.className = "err"; target.closest("label").appendChild(span); }
  span.textContent = message;
  const det = target.closest("details");
  if (det) det.open = true;
}

// ------------------------------------------------------------------------------------- explorer
async function update() {
  const body = collect(), my = ++seqEst;
  $("#status").textContent = "estimating…";
  try {
    const res = await api("/api/estimate", body);
    if (my !== seqEst) return;
    showError(null);
    $("#outputs").classList.remove("stale");
    $("#export").disabled = false;
    lastEstimate = res;
    render(res, body);
    $("#status").textContent = "";
  } catch (e) {
    if (my !== seqEst) return;
    showError(e.message, e.key);
    $("#outputs").classList.add("stale");
    $("#export").disabled = true;  // the shown numbers and their TOML belong to the last possible layout
    $("#status").textContent = e.status === 400 ? "impossible layout" : "error";
  }
}

const MEM_LABELS = { cpu_optim: "host (offloaded optimizer)", disk_optim: "disk (nvme offload files)" };

function render(res, body) {
  const r = res.estimate, pg = r.per_gpu, d = r.memory_detail;
  const parts = ["params", "grads", "optim", "activations", "buffers"].map((k) => ({ name: k, value: pg[k] }));
  stackedBar($("#mem-bar"), parts, { limit: r.usable_bytes, fmt: fmtBytes, bad: r.fits === false,
    limitLabel: `usable ${fmtBytes(r.usable_bytes)} of ${fmtBytes(r.hbm_bytes)}` });
  const t = $("#mem-table");
  t.innerHTML = "<tr><th></th><th>per GPU</th></tr>" + ["params", "grads", "optim", "activations", "buffers", "total", "cpu_optim", "disk_optim"]
    .map((k) => `<tr><td>${MEM_LABELS[k] || k}</td><td id="mem-${k}" data-bytes="${pg[k]}">${fmtBytes(pg[k])}</td></tr>`).join("");
  Object.assign(t.dataset, { model: body["model.preset"], gpus: body.gpus, tp: body["parallel.tp"] || 1 });
  $("#mem-caption").innerHTML = `worst rank: ${d.stage} stage, ${d.layers} layers, ${fmtNum(d.inflight_microbatches)} micro-batches in flight — ` +
    (r.fits ? `<span class="fit">fits</span>` : `<span class="nofit">does not fit</span>`);
  $("#dp-derived").textContent = `= ${res.derived.dp}`;
  if (r.step_s === undefined) { $("#headline").textContent = "no time model without a peak FLOP/s"; return; }
  const tm = r.time;
  $("#headline").innerHTML = `<b>${fmtNum(r.step_s, 3)} s</b> per step · <b>${fmtNum(r.tokens_per_s_per_gpu, 0)}</b> tokens/s per GPU · ` +
    `MFU <b id="mfu">${(100 * r.mfu).toFixed(1)}%</b> · ${res.derived.global_batch} sequences × ${res.derived.microbatches} micro-batches per rank`;
  $("#time-caption").textContent = `bubble ${(100 * tm.bubble_fraction).toFixed(1)}% (${tm.bubble_source})`;
  stackedBar($("#time-bar"), [
    { name: "forward", value: tm.forward_s }, { name: "backward", value: tm.backward_s }, { name: "recompute", value: tm.recompute_s },
    { name: "exposed comm", value: tm.exposed_comm_microbatch_s + tm.exposed_comm_step_s }, { name: "bubble", value: tm.bubble_s },
    { name: "optimizer", value: tm.optimizer_s + tm.offload_s }], { fmt: (s) => fmtNum(s, 3) + " s" });
  $("#time-caption").textContent += tm.offload_io_s ? ` · nvme offload disk I/O ${fmtNum(tm.offload_io_s, 3)} s of the optimizer's ${fmtNum(tm.offload_s, 3)} s` : "";
  // the per-operation model's breakdown of the compute (plan/ops.py); absent with a flat --efficiency
  const ops = r.ops || {};
  $("#ops-table").innerHTML = r.ops ? "<tr><th>compute by operation</th><th>s per step</th></tr>" +
    ["gemm_s", "attention_s", "elementwise_s", "launch_s", "grad_accum_s", "head_s", "loss_s", "recompute_s"]
      .map((k) => `<tr><td>${k.replace("_s", "").replace("_", " ")}</td><td id="ops-${k}">${fmtNum(ops[k], 3)}</td></tr>`).join("") : "";
  $("#comm-table").innerHTML = "<tr><th>group</th><th>collective</th><th>link</th><th>ranks</th><th>GB/step</th><th>time s</th><th>exposed s</th><th>hidden</th><th>behind</th></tr>" +
    (r.comm.length ? r.comm.map((c) => `<tr><td>${c.group}</td><td>${c.kind}</td><td>${c.link}</td><td>${c.group_size}</td><td>${(c.bytes / 1e9).toFixed(2)}</td>` +
      `<td>${fmtNum(c.seconds, 3)}</td><td>${fmtNum(c.exposed_s, 3)}</td><td>${c.seconds ? (100 * (1 - c.exposed_s / c.seconds)).toFixed(0) + "%" : "-"}</td><td>${c.overlaps_with}</td></tr>`).join("")
      : "<tr><td colspan=9>no communication: one GPU</td></tr>");
  drawPipeline($("#pipe"), $("#pipe-caption"), res.pipeline, "pp = 1: no pipeline");
}

function drawPipeline(svg, caption, tl, none) {
  if (!tl || tl.skipped) { clear(svg); svg.style.height = "10px"; caption.textContent = tl ? tl.skipped : none; return; }
  timeline(svg, tl);
  caption.textContent = `${tl.name}, ${tl.p} ranks × ${tl.m} micro-batches × ${tl.v} chunks (${tl.source}): ` +
    `${(100 * tl.bubble).toFixed(1)}% of the ranks' time idle`;
}

const PLAN_KEYS = (k) => !k.startsWith("parallel.") && k !== "training.micro_batch" && k !== "training.ac";

async function runPlan() {
  const body = Object.fromEntries(Object.entries(collect()).filter(([k]) => PLAN_KEYS(k))), my = ++seqPlan;
  $("#plan-caption").textContent = "searching…";
  try {
    const res = await api("/api/plan", body);
    if (my !== seqPlan) return;
    const c = res.counts;
    $("#plan-caption").textContent = `meshlm plan: ${(c.candidates || 0).toLocaleString()} layouts in ${res.elapsed_s.toFixed(2)} s, ` +
      `${(c.fit || 0).toLocaleString()} fit, ${(c.oom || 0).toLocaleString()} out of memory — click a row to load it`;
    const rows = res.ranked.map((r, i) => {
      const L = r.layout, sched = L.pp === 1 ? "-" : L.pp_schedule + (L.pp_virtual > 1 ? " v" + L.pp_virtual : "");
      const zero = L.zero + (L.zero && L.zero_group !== L.dp ? " g" + L.zero_group : "");
      return `<tr data-i="${i}"><td>${i + 1}</td><td>${fmtNum(r.tokens_per_s_per_gpu, 0)}</td><td>${(100 * r.mfu).toFixed(1)}%</td><td>${fmtNum(r.step_s, 2)}</td>` +
        `<td>${(r.per_gpu_total / 2 ** 30).toFixed(1)}</td><td>${L.tp}${L.sp ? "+sp" : ""}</td><td>${L.pp}</td><td>${sched}</td><td>${L.cp}</td><td>${L.dp}</td>` +
        `<td>${zero}</td><td>${L.micro_batch}×${L.microbatches}</td><td>${L.ac}</td><td>${L.offload}</td></tr>`;
    });
    const t = $("#plan-table");
    t.innerHTML = "<thead><tr><th>#</th><th>tok/s/GPU</th><th>MFU</th><th>step s</th><th>GiB</th><th>tp</th><th>pp</th><th>schedule</th><th>cp</th><th>dp</th><th>zero</th><th>mb×m</th><th>ac</th><th>offload</th></tr></thead><tbody>" +
      (rows.join("") || "<tr><td colspan=14>no layout fits</td></tr>") + "</tbody>";
    for (const tr of t.querySelectorAll("tbody tr[data-i]")) tr.onclick = () => loadLayout(res.ranked[+tr.dataset.i].layout);
  } catch (e) {
    if (my === seqPlan) $("#plan-caption").textContent = e.message;
  }
}

function loadLayout(L) {
  const v = { "parallel.dp": -1, "parallel.zero": L.zero, "parallel.zero_group": L.zero && L.zero_group !== L.dp ? L.zero_group : 0,
    "parallel.tp": L.tp, "parallel.sp": L.sp, "parallel.pp": L.pp, "parallel.pp_schedule": L.pp_schedule, "parallel.pp_virtual": L.pp_virtual,
    "parallel.cp": L.cp, "parallel.cp_impl": L.cp_impl, "parallel.ep": L.ep, "parallel.offload": L.offload,
    "parallel.quantize_weights": !!L.quantize_weights, "parallel.hpz_group": L.hpz_group || 0,
    "parallel.quantize_grads": !!L.quantize_grads, "training.micro_batch": L.micro_batch, "training.ac": L.ac };
  for (const [k, x] of Object.entries(v)) setValue(k, x);
  lastChanged = null;
  update();
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
  for (const [k, x] of Object.entries(LAYOUT_DEFAULTS)) setValue(k, x);
  if (ex.inputs["model.preset"]) { setValue("model.preset", ex.inputs["model.preset"]); setPreset(ex.inputs["model.preset"]); }
  for (const [k, x] of Object.entries(ex.inputs)) setValue(k, x);
  $("#form-error").textContent = ex.note;
  lastChanged = null;
  update();
  runPlan();
}

// ------------------------------------------------------------------------------------- runs
let currentRun = null;

async function loadRuns() {
  const res = await api("/api/runs");
  $("#runs-root").textContent = res.root;
  const ul = $("#run-list");
  ul.innerHTML = res.runs.map((r) => `<li data-name="${encodeURIComponent(r.name)}" class="${r.name === currentRun ? "active" : ""}">${r.name}` +
    `<small>${r.steps} steps${r.loss !== null && r.loss !== undefined ? ", loss " + r.loss.toFixed(3) : ""}</small></li>`).join("") || "<li>no runs yet</li>";
  for (const li of ul.querySelectorAll("li[data-name]")) li.onclick = () => selectRun(decodeURIComponent(li.dataset.name));
}

async function selectRun(name) {
  currentRun = name;
  for (const li of document.querySelectorAll("#run-list li")) li.classList.toggle("active", li.dataset.name === encodeURIComponent(name));
  await refreshRun();
}

async function refreshRun() {
  if (!currentRun) return;
  let r;
  try { r = await api("/api/run?name=" + encodeURIComponent(currentRun)); } catch (e) { $("#run-title").textContent = e.message; return; }
  $("#run-title").textContent = r.name;
  const S = r.steps, pts = (k) => S.filter((x) => x[k] !== undefined).map((x) => [x.step, x[k]]);
  lineChart($("#chart-loss"), [{ name: "train", cls: "train", points: pts("loss"), dots: true },
    { name: "eval", cls: "eval", points: r.evals.map((x) => [x.step, x.eval_loss]), dots: true }], {});
  $("#chart-loss").dataset.run = r.name;
  lineChart($("#chart-tps"), [{ name: "tokens/s", cls: "tps", points: pts("tokens_per_s") }], {});
  lineChart($("#chart-mfu"), [{ name: "MFU %", cls: "mfu", points: S.map((x) => [x.step, 100 * x.mfu]) }], { ymin: 0 });
  const last = S[S.length - 1] || {};
  $("#peak-label").textContent = last.peak_flops ? `peak ${fmtNum(last.peak_flops / 1e12, 3)} TFLOP/s: ${last.peak_label}` : "";
  const p = r.prediction, m = last.mem || {};
  $("#pred-caption").textContent = p.error ? "planner: " + p.error : `planner: ${p.stage} stage of ${p.world} ranks (world from ${p.world_source})`;
  const pm = p.per_gpu || {};
  $("#run-mem").innerHTML = "<tr><th></th><th>measured</th><th>planner</th></tr>" +
    [["params", "params"], ["grads", "grads"], ["optim", "optim"], ["activations", null], ["buffers", null], ["peak (allocator or RSS) / total", "total"]]
      .map(([k, pk]) => `<tr><td>${k}</td><td>${fmtBytes(m[k.split(" ")[0]])}</td><td>${pk ? fmtBytes(pm[pk]) : fmtBytes(pm[k])}</td></tr>`).join("");
  const comm = Object.entries(last.comm || {});
  $("#run-comm").innerHTML = "<tr><th>collective</th><th>calls/step</th><th>bytes/step</th><th>seconds/step</th></tr>" +
    (comm.map(([k, c]) => `<tr><td>${k}</td><td>${fmtNum(c.calls, 0)}</td><td>${fmtBytes(c.bytes)}</td><td>${fmtNum(c.seconds, 4)}</td></tr>`).join("") ||
      "<tr><td colspan=4>none: one process</td></tr>");
  const ev = r.incidents || [];
  $("#run-events-card").hidden = !ev.length;
  $("#run-events").replaceChildren(...ev.map((x) => { const li = document.createElement("li"); li.textContent = x; return li; }));
  const bub = pts("bubble");
  $("#run-pipe-card").hidden = !bub.length && !r.pipeline;
  if (bub.length) lineChart($("#chart-bubble"), [{ name: "measured bubble %", cls: "bubble", points: bub.map(([s, b]) => [s, 100 * b]) }], { ymin: 0 });
  drawPipeline($("#run-pipe"), $("#run-pipe-caption"), r.pipeline, "no pipeline trace");
}

function showView(name) {
  for (const b of document.querySelectorAll("header nav .tab")) b.classList.toggle("active", b.dataset.view === name);
  $("#view-explorer").hidden = name !== "explorer";
  $("#view-runs").hidden = name !== "runs";
  if (name === "runs") loadRuns().then(refreshRun);
  else if (lastEstimate) render(lastEstimate, collect());
}

// ------------------------------------------------------------------------------------- start
async function start() {
  OPTIONS = await api("/api/options");
  fillSelect("model.preset", Object.keys(OPTIONS.presets));
  const gpus = Object.keys(OPTIONS.gpus);
  fillSelect("gpu", gpus.concat(["custom"]), gpus.map((g) => OPTIONS.gpus[g].name).concat(["custom (give peak, HBM, links)"]));
  for (const [k, vals] of Object.entries(OPTIONS.choices)) fillSelect(k, vals);
  for (const [k, x] of Object.entries(LAYOUT_DEFAULTS)) setValue(k, x);
  setValue("model.preset", "llama3-8b");
  setPreset("llama3-8b");
  setValue("gpu", "h100-sxm-80gb");
  setValue("training.precision", "bf16");
  setValue("global_batch_tokens", OPTIONS.defaults.global_batch_tokens);
  api("/api/runs").then((res) => {  // runs to calibrate from (docs/planner.md, "Calibration from a run")
    for (const r of res.runs) input("calibrate").add(new Option(r.name, r.name));
  }).catch(() => {});
  input("efficiency").placeholder = OPTIONS.defaults.efficiency;
  input("comm_efficiency").placeholder = OPTIONS.defaults.comm_efficiency;
  for (const ex of OPTIONS.examples) {
    const b = document.createElement("button");
    b.type = "button"; b.textContent = ex.label; b.title = ex.note; b.onclick = () => applyExample(ex);
    $("#examples").appendChild(b);
  }
  form.addEventListener("input", (e) => {
    if (!e.target.name) return;
    lastChanged = e.target.name;
    if (e.target.name === "model.preset") setPreset(e.target.value);
    $("#form-error").textContent = "";
    debounce("estimate", 120, update);
    if (PLAN_KEYS(e.target.name)) debounce("plan", 600, runPlan);
  });
  $("#export").onclick = exportConfig;
  for (const b of document.querySelectorAll("header nav .tab")) b.onclick = () => showView(b.dataset.view);
  setInterval(() => { if (!$("#view-runs").hidden) loadRuns().then(refreshRun).catch(() => {}); }, 2000);
  await update();
  runPlan();
}

start();
