// meshlm explore: start-up and the wiring between the form (form.js), the explorer (explorer.js),
// the runs dashboard (runs.js) and the charts (charts.js). Classic scripts sharing one global scope.
"use strict";

// A user's change to input `name`: an example's note goes, the estimate follows, and the search too
// when the change is one of its inputs.
function changed(name) {
  lastChanged = name;
  if (name === "model.preset") setPreset(input(name).value);
  if (name === "gpu") syncCluster();
  showNote("");
  debounce("estimate", 120, update);
  if (PLAN_KEYS(name)) debounce("plan", 600, runPlan);
}

function showView(name) {
  for (const b of document.querySelectorAll("header nav .tab")) b.classList.toggle("active", b.dataset.view === name);
  $("#view-explorer").hidden = name !== "explorer";
  $("#view-runs").hidden = name !== "runs";
  if (name === "runs") loadRuns().then(refreshRun);
  else if (lastEstimate) render(lastEstimate, collect());
}

function fillInputs() {
  fillSelect("model.preset", Object.keys(OPTIONS.presets));
  const gpus = Object.keys(OPTIONS.gpus);
  fillSelect("gpu", gpus.concat(["custom", "mixed"]), gpus.map((g) => OPTIONS.gpus[g].name)
    .concat(["custom (give peak, HBM, links)", "mixed cluster (types:counts)"]));
  for (const [k, vals] of Object.entries(OPTIONS.choices)) fillSelect(k, vals);
  setLayout({});
  setValue("model.preset", "llama3-8b");
  setPreset("llama3-8b");
  setValue("gpu", "h100-sxm-80gb");
  setValue("training.precision", "bf16");
  setValue("training.compile", "auto");  // as `meshlm plan`: compiled on a GPU, eager for a CPU run's calibration
  setValue("global_batch_tokens", OPTIONS.defaults.global_batch_tokens);
  for (const [k, v] of Object.entries(OPTIONS.course_defaults)) setValue(k, Array.isArray(v) ? v.join(", ") : v);
  syncCluster();
  input("efficiency").placeholder = OPTIONS.defaults.efficiency ?? "per operation";  // null: plan/cost/ops.py's model
  input("comm_efficiency").placeholder = OPTIONS.defaults.comm_efficiency;
  api("/api/runs").then((res) => {  // runs to calibrate from (docs/planner.md, "Calibration from a run")
    for (const r of res.runs) input("calibrate").add(new Option(r.name, r.name));
  }).catch(() => {});
}

async function start() {
  OPTIONS = await api("/api/options");
  fillInputs();
  for (const ex of OPTIONS.examples) {
    const b = document.createElement("button");
    b.type = "button"; b.textContent = ex.label; b.title = ex.note; b.onclick = () => applyExample(ex);
    $("#examples").appendChild(b);
  }
  form.addEventListener("input", (e) => { if (e.target.name) changed(e.target.name); });
  $("#export").onclick = exportConfig;
  for (const b of document.querySelectorAll("header nav .tab")) b.onclick = () => showView(b.dataset.view);
  setInterval(() => { if (!$("#view-runs").hidden) loadRuns().then(refreshRun).catch(() => {}); }, 2000);
  await update();
  runPlan();
}

start();
