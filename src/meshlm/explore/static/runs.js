// The runs dashboard: the run directories under --runs, and one run's curves next to the planner.
"use strict";

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

function predictionCaption(p) {  // rank 0 is what the run measured; the planner's stage of it
  if (p.error) return "planner: " + p.error;
  const ranks = p.world === 1 ? "1 rank" : `${p.world} ranks`;
  return `planner: rank 0 of ${ranks}, ${p.stage === "first" ? "the first pipeline stage" : "no pipeline"} — ` +
    `world size from ${p.world_source}`;
}

function renderRunTables(r, last) {
  const p = r.prediction, m = last.mem || {}, pm = p.per_gpu || {};
  $("#pred-caption").textContent = predictionCaption(p);
  $("#run-mem").innerHTML = "<tr><th></th><th>measured</th><th>planner</th></tr>" +
    [["params", "params"], ["grads", "grads"], ["optim", "optim"], ["activations", null], ["buffers", null], ["peak (allocator or RSS) / total", "total"]]
      .map(([k, pk]) => `<tr><td>${k}</td><td>${fmtBytes(m[k.split(" ")[0]])}</td><td>${pk ? fmtBytes(pm[pk]) : fmtBytes(pm[k])}</td></tr>`).join("");
  const comm = Object.entries(last.comm || {});
  $("#run-comm").innerHTML = "<tr><th>collective</th><th>calls/step</th><th>bytes/step</th><th>seconds/step</th></tr>" +
    (comm.map(([k, c]) => `<tr><td>${k}</td><td>${fmtNum(c.calls, 0)}</td><td>${fmtBytes(c.bytes)}</td><td>${fmtNum(c.seconds, 4)}</td></tr>`).join("") ||
      "<tr><td colspan=4>none: one process</td></tr>");
}

function renderEnergy(S) {  // measured power and J/token (docs/energy.md, "Measured energy"); null: not measured
  const val = (k) => S.filter((x) => x[k] !== undefined && x[k] !== null).map((x) => [x.step, x[k]]);
  const power = val("power_w"), jpt = val("j_per_token"), kwh = val("energy_j").reduce((a, [, j]) => a + j, 0) / 3.6e6;
  $("#run-energy-card").hidden = !power.length && !jpt.length;
  if (!power.length && !jpt.length) return;
  $("#run-energy-caption").textContent = `${fmtNum(kwh, 4)} kWh measured, summed over the job`;
  lineChart($("#chart-power"), [{ name: "power W", cls: "power", points: power }], { ymin: 0 });
  lineChart($("#chart-jpt"), [{ name: "J/token", cls: "jpt", points: jpt }], { ymin: 0 });
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
  renderRunTables(r, last);
  const ev = r.incidents || [];
  $("#run-events-card").hidden = !ev.length;
  $("#run-events").replaceChildren(...ev.map((x) => { const li = document.createElement("li"); li.textContent = x; return li; }));
  renderEnergy(S);
  const bub = pts("bubble");
  $("#run-pipe-card").hidden = !bub.length && !r.pipeline;
  if (bub.length) lineChart($("#chart-bubble"), [{ name: "measured bubble %", cls: "bubble", points: bub.map(([s, b]) => [s, 100 * b]) }], { ymin: 0 });
  drawPipeline($("#run-pipe"), $("#run-pipe-caption"), r.pipeline, "no pipeline trace");
}
