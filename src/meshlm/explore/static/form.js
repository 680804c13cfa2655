// The explorer's form. Inputs are named by the API's keys (config keys like "parallel.tp", or
// estimate/plan flags like "gpus"), so a request is just the form, and an error's key names its input.
"use strict";

const $ = (s) => document.querySelector(s);
const form = $("#inputs");
const SHAPE = ["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings"];
let OPTIONS = null, lastChanged = null;

const input = (name) => form.elements.namedItem(name);
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

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

// A layout key the form has no control for (a list such as parallel.pp_layers) is kept read-only in
// #extras, so the request still carries it; "clear" drops it back to the config's default.
function showExtra(key, value, dflt) {
  const old = form.querySelector(`output[name="${key}"]`);
  if (same(value, dflt)) { if (old) old.closest("label").remove(); return; }
  const out = old || Object.assign(document.createElement("output"), { name: key });
  out.dataset.value = JSON.stringify(value);
  out.textContent = Array.isArray(value) ? value.join(", ") : String(value);
  if (old) return;
  const label = document.createElement("label"), clear = document.createElement("button");
  label.className = "extra";
  label.title = "set by the plan row you loaded; the form has no control for it";
  clear.type = "button"; clear.textContent = "clear"; clear.className = "clear";
  clear.onclick = () => { label.remove(); changed(key); };
  label.append(key.split(".").pop() + " ", out, clear);
  $("#extras").appendChild(label);
}

// Every layout key at once: a plan row's values, or (missing keys) the config's defaults.
function setLayout(values) {
  for (const [k, dflt] of Object.entries(OPTIONS.layout_defaults)) {
    const v = k in values ? values[k] : dflt, e = input(k);
    if (e && e.tagName !== "OUTPUT") setValue(k, v); else showExtra(k, v, dflt);
  }
}

// A mixed cluster is the GPU select's "mixed" choice plus the cluster text (sent as `gpu`, as
// `meshlm plan --gpu h100:8,a100-80gb:8`); the count is the cluster's, so the GPUs field only shows it.
const isMixed = () => input("gpu").value === "mixed";

function syncCluster() {
  $("#cluster-label").hidden = !isMixed();
  input("gpus").disabled = isMixed();
}

// The first input the browser cannot read as a number, or a required one left blank: [key, message].
function invalidInput() {
  if (isMixed() && !input("cluster").value.trim())
    return ["cluster", "gpu: give the cluster as TYPE:COUNT,... (e.g. h100:8,a100-80gb:8)"];
  for (const e of form.elements) {
    if (!e.name || e.type !== "number" || e.disabled || e.closest("[hidden]")) continue;
    if (e.validity.badInput) return [e.name, `${e.name}: not a number`];
    if (e.required && e.value.trim() === "") return [e.name, `${e.name}: required, got a blank value`];
  }
  return null;
}

function collect() {
  const body = {};
  for (const e of form.elements) {
    if (!e.name || e.disabled || e.name === "cluster") continue;
    if (e.tagName === "OUTPUT") { body[e.name] = JSON.parse(e.dataset.value); continue; }
    let v = e.type === "checkbox" ? e.checked : e.value;
    if (e.type !== "checkbox" && v === "") continue;  // optional: blank keeps the preset's / profile's
    if (e.type === "number" || e.name === "parallel.zero") v = Number(v);
    if (e.dataset.preset !== undefined && String(v) === e.dataset.preset) continue;
    body[e.name] = v;
  }
  if (isMixed()) body.gpu = input("cluster").value.trim();
  return body;
}

function showError(message, key) {
  for (const e of form.querySelectorAll("label .err")) e.textContent = "";
  $("#form-error").textContent = "";
  for (const e of form.querySelectorAll(".bad")) e.classList.remove("bad");
  if (!message) return;
  // next to the input that causes it: the key's input, or the one just changed if the message names it
  let target = key && input(key);
  const short = lastChanged && lastChanged.split(".").pop();
  if (lastChanged && lastChanged !== key && input(lastChanged) && short &&
      new RegExp(`\\b${short}\\b`).test(message.replace(/×/g, " "))) target = input(lastChanged);
  if (target === input("gpu") && isMixed()) target = input("cluster");  // the cluster's own text is at fault
  if (!target || !target.closest("label")) { $("#form-error").textContent = message; return; }
  target.classList.add("bad");
  let span = target.closest("label").querySelector(".err");
  if (!span) { span = document.createElement("span"); span.className = "err"; target.closest("label").appendChild(span); }
  span.textContent = message;
  const det = target.closest("details");
  if (det) det.open = true;
}

function showNote(text) { $("#note").textContent = text || ""; }  // an example's note: until the next change
