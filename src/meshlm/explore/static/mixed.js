// A mixed cluster (gpu = "h100:8,a100-80gb:8"): the estimate's per-type facts and the mixed plan, whose
// rows place pipeline stages or data replicas on each card type (plan/mixed/cli.py's JSON, as drawn
// by `meshlm plan --gpu TYPE:COUNT,...`), and its comparison with the fastest type alone.
"use strict";

const GIB = 2 ** 30;

function holds(r, t) {  // what one type's ranks hold: stages of blocks, or replicas of sequences
  const n = t.units, s = n > 1 ? "s" : "";
  return r.spans === "pp" ? `${n} stage${s}, ${t.layers.join("+")} blocks` : `${n} replica${s}, ${t.sequences[0]} sequences each`;
}

function perTypeRows(r) {
  return "<tr><th>device type</th><th>GPUs</th><th>holds</th><th>memory GiB (usable)</th><th>compute s of the step</th></tr>" +
    r.per_type.map((t) => `<tr data-card="${t.card}" class="${t.bytes > t.usable ? "nofit" : ""}"><td>${t.gpu}</td><td>${t.gpus}</td>` +
      `<td>${holds(r, t)}</td><td>${(t.bytes / GIB).toFixed(1)} (${(t.usable / GIB).toFixed(1)})</td>` +
      `<td>${fmtNum(t.busy_s, 3)} of ${fmtNum(r.step_s, 3)}</td></tr>`).join("");
}

// The estimate of the form's layout on a mixed cluster: per-type memory and compute, the step.
function renderMixed(res, body) {
  const r = res.mixed;
  setValue("gpus", r.gpus);
  $("#dp-derived").textContent = `= ${r.layout.dp}`;
  const fullest = r.per_type.reduce((a, t) => (t.bytes / t.usable > a.bytes / a.usable ? t : a));
  stackedBar($("#mem-bar"), r.per_type.map((t) => ({ name: t.gpu, value: t === fullest ? t.bytes : 0 })),
    { limit: fullest.usable, fmt: fmtBytes, bad: !r.fits, limitLabel: `usable on the ${fullest.gpu}: ${fmtBytes(fullest.usable)}` });
  const t = $("#mem-table");
  t.innerHTML = perTypeRows(r);
  Object.assign(t.dataset, { model: body["model.preset"], gpus: r.gpus, tp: body["parallel.tp"] || 1, mixed: r.spans });
  $("#mem-caption").innerHTML = `fullest rank per device type (the bar: the ${fullest.gpu}) — ` +
    (r.fits ? `<span class="fit">fits</span>` : `<span class="nofit">does not fit</span>`);
  const h = $("#headline");
  h.dataset.step = r.step_s;
  h.innerHTML = `<b>${fmtNum(r.step_s, 3)} s</b> per step · <b>${fmtNum(r.tokens_per_s_per_gpu, 0)}</b> tokens/s per GPU · ` +
    `MFU <b id="mfu">${(100 * r.mfu).toFixed(1)}%</b> of the summed peak · ` +
    (r.spans === "pp" ? `stages split by speed (pp_layers ${r.layout.pp_layers.join("/")})` : `dp_weights ${r.layout.dp_weights.join(", ") || "even"}`);
  $("#time-caption").textContent = `mixed cluster: ${r.layout.devices.join(", ")}; pipeline makespan: ${r.bubble_source}`;
  $("#time-bar").style.display = "none";  // the types compute side by side: their seconds are in the memory card's table
  $("#ops-table").innerHTML = "";
  $("#comm-table").innerHTML = "<tr><td>a mixed cluster's step is priced per card type (meshlm estimate gives no per-collective table)</td></tr>";
  drawPipeline($("#pipe"), $("#pipe-caption"), null, "mixed cluster: stages priced per card, not drawn");
}

function splitText(L) {
  if (L.pp_layers.length) return "layers " + L.pp_layers.join("/");
  const runs = [];
  for (const w of L.dp_weights) { if (runs.length && runs[runs.length - 1][0] === w) runs[runs.length - 1][1]++; else runs.push([w, 1]); }
  return runs.length ? "weights " + runs.map(([w, n]) => `${w}×${n}`).join(", ") : "-";
}

function mixedRow(r, i) {
  const L = r.layout, sched = L.pp === 1 ? "-" : L.pp_schedule + (L.pp_virtual > 1 ? " v" + L.pp_virtual : "");
  return `<tr data-i="${i}" data-step="${r.step_s}" data-bytes="${r.per_gpu.total}"><td>${i + 1}</td><td>${fmtNum(r.tokens_per_s_per_gpu, 0)}</td>` +
    `<td>${(100 * r.mfu).toFixed(1)}%</td><td>${fmtNum(r.step_s, 2)}</td><td>${(r.per_gpu.total / GIB).toFixed(1)}</td><td>${r.spans}</td>` +
    `<td>${L.tp}${L.sp ? "+sp" : ""}</td><td>${L.pp}</td><td>${sched}</td><td>${L.cp}</td><td>${L.dp}</td><td>${L.zero}</td>` +
    `<td>${L.micro_batch}×${L.microbatches}</td><td>${L.ac}</td><td>${L.offload}</td><td>${splitText(L)}</td></tr>`;
}

// plan/mixed/cli.py `_comparison_lines` in words: does adding the slower cards pay?
function comparisonHtml(res) {
  const c = res.comparison;
  const alone = `${c.alone_gpus} × ${c.alone_gpu}`;
  if (c.alone_step_s === null)
    return `<p>fastest type alone: ${alone} fit no layout of this model and batch: the slower cards are needed</p>`;
  const a = c.alone_layout;
  let out = `<p>fastest type alone: ${alone}, tp${a.tp} pp${a.pp} cp${a.cp} dp${a.dp} zero${a.zero}: step ` +
    `<b>${fmtNum(c.alone_step_s, 2)} s</b></p>`;
  if (c.mixed_step_s === null) return out + `<p class="verdict nofit">the slower cards do not pay: no mixed layout fits; train on the ${c.alone_gpu}s alone</p>`;
  const gain = `${c.gain >= 0 ? "+" : ""}${(100 * c.gain).toFixed(1)}%`;
  const added = "adding " + res.ranked[0].per_type.filter((t) => t.gpu !== c.alone_gpu).map((t) => `${t.gpus} × ${t.gpu}`).join(" + ");
  out += c.pays ? `<p class="verdict fit">${added}: step ${fmtNum(c.mixed_step_s, 2)} s, ${gain} tokens/s against the ${c.alone_gpu}s alone (they pay)</p>`
    : `<p class="verdict nofit">${added} does not pay: the best mixed layout's step is ${fmtNum(c.mixed_step_s, 2)} s, ` +
      `${gain} tokens/s against the ${c.alone_gpu}s alone; train on the ${c.alone_gpu}s alone</p>`;
  return out;
}

function renderMixedPlan(res, body) {
  const c = res.counts, n = (k) => (c[k] || 0).toLocaleString();
  $("#plan-caption").innerHTML = `meshlm plan (mixed): <span data-count="candidates">${n("candidates")}</span> layouts searched in ` +
    `${res.elapsed_s.toFixed(2)} s: <span data-count="fit">${n("fit")}</span> fit, <span data-count="oom">${n("oom")}</span> out of memory, ` +
    `<span data-count="invalid">${n("invalid")}</span> invalid, ${n("bounded")} ruled out by their compute alone` +
    (res.ranked.length ? " — click a row to load it" : " — no mixed layout fits");
  const t = $("#plan-table");
  Object.assign(t.dataset, { model: body["model.preset"], gpus: body.gpu, loaded: "" });
  t.innerHTML = "<thead><tr><th>#</th><th>tok/s/GPU</th><th>MFU</th><th>step s</th><th>GiB</th><th>spans</th><th>tp</th><th>pp</th>" +
    "<th>schedule</th><th>cp</th><th>dp</th><th>zero</th><th>mb×m</th><th>ac</th><th>offload</th><th>split</th></tr></thead><tbody>" +
    (res.ranked.map(mixedRow).join("") || "<tr><td colspan=16>no mixed layout fits</td></tr>") + "</tbody>";
  for (const tr of t.querySelectorAll("tbody tr[data-i]")) tr.onclick = () => loadRow(res.ranked[+tr.dataset.i], +tr.dataset.i);
  const best = res.ranked[0];
  Object.assign($("#plan-compare").dataset, { pays: res.comparison.pays, alone: res.comparison.alone_step_s ?? "" });
  $("#plan-compare").innerHTML = comparisonHtml(res) +
    (best ? `<table class="nums"><caption>best mixed layout, per device type</caption>${perTypeRows(best)}</table>` : "");
}
