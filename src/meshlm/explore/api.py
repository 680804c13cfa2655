"""The explorer's JSON API: the page's inputs in, the planner's own answers out.

A request is one flat JSON object. Keys with a dot are config keys (`parallel.tp`, `model.preset`,
`training.ac`, ...) and go through `config.apply`, exactly as `--section.key value` does on the
command line; the other keys are the `meshlm estimate` / `meshlm plan` flags (`gpu`, `gpus`,
`peak_tflops`, `efficiency`, ...) plus `global_batch_tokens`. So the page computes what the CLI
computes, and every error is the planner's own one-line message, whose leading key names the input
that caused it.
"""
from __future__ import annotations

import json
import os
import re

from ..core import config as C
from ..core.choices import DECAY_TYPES, LR_SCHEDULES, OPTIMIZERS
from ..plan.cluster import Cluster, check_world, is_mixed_flag, parse_cluster
from ..plan.cost.estimate import SIMULATED, Options, estimate, schedule_timeline
from ..plan.hardware import FLAG_FIELDS, PROFILES, HardwareError, get_gpu
from ..plan.mixed.search import plan_mixed
from ..plan.mixed.cli import comparison, estimate_mixed, mixed_config, row
from ..plan.cost.ops import KERNELS
from ..plan.search.objective import pareto_front, price_rows
from ..plan.search.ranked import plan
from ..plan.cost.energy import Site, power_of, priced
from ..plan.spec import AC_MODES, CP_IMPLS, PRECISIONS, SCHEDULES, PlanError, presets, priced_on, \
    search_knobs, shape_from_config, spec_from_config, spec_of_layout, to_config
from .course import COURSE_KEYS, check_course, mixed_run_total, run_total, sample_course

MAX_GPUS = 1 << 17           # a search over more is a typo, not a cluster
MAX_TIMELINE_UNITS = 4096    # p·m·v above which the timeline is not simulated for drawing (~1 s)
FLAGS = {"gpu", "gpus", "global_batch_tokens", "efficiency", "comm_efficiency", "flash", "top",
         "attn_kernel", "calibrate"} | set(FLAG_FIELDS)
# config keys the page may set (all of them are also `meshlm estimate --section.key` overrides)
CONFIG_KEYS = {f"model.{k}" for k in ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                      "tie_embeddings", "vocab_multiple")} \
    | {f"model.moe.{k}" for k in ("num_experts", "top_k", "capacity_factor", "shared_experts")} \
    | {"data.seq_len", "optim.name"} \
    | {f"training.{k}" for k in ("precision", "compile", "micro_batch", "ac")} \
    | {f"parallel.{k}" for k in ("dp", "zero", "zero_group", "tp", "sp", "pp", "pp_schedule", "pp_virtual",
                                 "pp_layers", "microbatches", "cp", "cp_impl", "ep", "offload", "offload_buffer_mb",
                                 "bucket_mb", "reduce_dtype", "quantize_weights", "hpz_group", "quantize_grads",
                                 "dp_weights")} \
    | set(COURSE_KEYS)
SEARCHED = ("parallel.", "training.micro_batch", "training.ac")  # the keys a plan row sets (the search chooses)
LAYOUT_INPUTS = sorted(k for k in CONFIG_KEYS if k.startswith(SEARCHED))
REQUIRED_FLAGS = {"gpus", "global_batch_tokens", "top"}  # blank is an error; other blank flags keep the profile's
# where an error whose leading key is not an input belongs
KEY_ALIASES = {"training.global_batch": "global_batch_tokens", "parallel": "gpus", "parallel.microbatches":
               "training.micro_batch", "seq_len": "data.seq_len", "model": "model.preset"}

EXAMPLES = [  # seed 004's "Try these configurations", as the explorer's three buttons
    {"label": "7B on 8 GPUs", "note": "pure DP: the model states alone outgrow 80 GB; turn on ZeRO-3 (FSDP)",
     "inputs": {"model.preset": "llama3-8b", "gpu": "h100-sxm-80gb", "gpus": 8, "parallel.tp": 1, "parallel.pp": 1,
                "parallel.zero": 0}},
    {"label": "405B on 128 GPUs", "note": "TP=8 + PP=4 + FSDP: each dimension cuts memory and adds traffic",
     "inputs": {"model.preset": "llama3-405b", "gpu": "h100-sxm-80gb", "gpus": 128, "parallel.tp": 8, "parallel.sp": True,
                "parallel.pp": 4, "parallel.zero": 3, "training.ac": "full"}},
    {"label": "405B on 8 GPUs", "note": "even TP=8 with FSDP does not fit: more GPUs or a smaller model",
     "inputs": {"model.preset": "llama3-405b", "gpu": "h100-sxm-80gb", "gpus": 8, "parallel.tp": 8, "parallel.sp": True,
                "parallel.pp": 1, "parallel.zero": 3, "training.ac": "full"}},
]


class BadRequest(ValueError):
    """Bad input: HTTP 400 with this one-line message; `key` names the input it belongs to."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key if key is not None else error_key(message)


NAME = re.compile(r"^[A-Za-z0-9_.+=@-][A-Za-z0-9_.+=@ -]{0,254}$")


class NotFound(LookupError):
    """HTTP 404 with this one-line message."""


def is_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metrics.jsonl")) or os.path.isfile(os.path.join(path, "config.toml"))


def run_path(root: str, name) -> str:
    """The directory of run `name`, or BadRequest (not a plain name / outside the root) / NotFound."""
    if not isinstance(name, str) or not NAME.match(name) or name in (".", "..") or ".." in name:
        raise BadRequest(f"run: {name!r} is not a run name (a directory directly under the runs root)", "run")
    base = os.path.realpath(root)
    path = os.path.realpath(os.path.join(base, name))
    if os.path.dirname(path) != base:
        raise BadRequest(f"run: {name!r} resolves outside the runs root", "run")
    if not os.path.isdir(path) or not is_run(path):
        raise NotFound(f"run: no run directory {name!r} under the runs root")
    return path


def error_key(message: str) -> str | None:
    """'parallel.tp: 3 does not divide ...' -> 'parallel.tp'; '--gpus: ...' -> 'gpus'."""
    m = re.match(r"^(--)?([a-z_][\w.-]*)[: ]", message)
    if not m:
        return None
    key = m.group(2).replace("-", "_") if m.group(1) else m.group(2)
    return KEY_ALIASES.get(key, key)


def options() -> dict:
    """What the page needs to draw its inputs: presets with their shapes, GPU profiles, choices."""
    models = {}
    for name, a in presets().items():
        models[name] = dict(a.to_dict(), params=a.num_params(), seq_len=a.pretrain_seq_len)
    gpus = {k: {"name": g.name, "peak_tflops": g.peak_flops / 1e12, "hbm_gb": g.hbm_bytes / 1e9,
                "hbm_tbps": g.hbm_bw / 1e12, "nvlink_gbps": g.nvlink_bw / 1e9, "ib_gbps": g.ib_bw / 1e9,
                "pcie_gbps": g.pcie_bw / 1e9, "gpus_per_node": g.gpus_per_node,
                "cpu_adam_gparams": g.cpu_adam_params_per_s / 1e9, "disk_read_gbps": g.disk_read_bw / 1e9,
                "disk_write_gbps": g.disk_write_bw / 1e9} for k, g in PROFILES.items()}
    return {"presets": models, "gpus": gpus,
            "choices": {"training.precision": list(PRECISIONS), "training.ac": list(AC_MODES),
                        "training.compile": ["auto", "true", "false"],
                        "parallel.pp_schedule": list(SCHEDULES), "parallel.cp_impl": list(CP_IMPLS),
                        "parallel.offload": ["none", "optimizer", "nvme"], "parallel.zero": [0, 1, 2, 3],
                        "optim.name": list(OPTIMIZERS), "optim.schedule": list(LR_SCHEDULES),
                        "optim.decay_type": list(DECAY_TYPES)},
            "attn_kernels": list(KERNELS),
            "defaults": {"efficiency": Options.efficiency, "comm_efficiency": Options.comm_efficiency,
                         "attn_kernel": Options.attn_kernel,
                         "global_batch_tokens": 2 ** 22},
            # what a layout key is when no plan row set it; micro-batch 1, not the config's 8 (sized for the tiny model)
            "layout_defaults": dict(layout_inputs(C.Config()), **{"training.micro_batch": 1}),
            # the schedule's inputs start at the config's defaults, as `meshlm estimate` without them
            "course_defaults": {k: _get(C.Config(), k) for k in COURSE_KEYS},
            "examples": EXAMPLES}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def layout_inputs(cfg: C.Config) -> dict:
    """Every layout key of a config as the page's inputs (a plan row's, or the defaults the page resets
    to), read from the config so that no key is left out. dp and microbatches go back to "derived"
    (-1, 0): the row's values are what those give, and the form keeps deriving them when the GPU count
    or batch changes."""
    out = {k: _get(cfg, k) for k in LAYOUT_INPUTS}
    return dict(out, **{"parallel.dp": -1, "parallel.microbatches": 0})


def _blank(v) -> bool:
    return v is None or (isinstance(v, str) and not v.strip())


# ---------------------------------------------------------------------------------- request parsing

def _number(body: dict, key: str, kind=float, default=None, low: float = 0.0):
    """A numeric flag: absent takes `default` (as the command line does); blank is an error for the
    REQUIRED_FLAGS, so an emptied field never turns into a default silently."""
    v = body.get(key, default)
    if _blank(v):
        if key in body and key in REQUIRED_FLAGS:
            raise BadRequest(f"{key}: required, got a blank value", key)
        return default
    try:
        if isinstance(v, bool):
            raise ValueError
        x = kind(v)
        if kind is int and float(v) != x:
            raise ValueError
    except (TypeError, ValueError):
        raise BadRequest(f"{key}: expected {'an integer' if kind is int else 'a number'}, got {v!r}", key) from None
    if x < low:
        raise BadRequest(f"{key}: must be >= {low:g}, got {x:g}", key)
    return x


def parse(body, layout: bool = True, runs_root: str | None = None):
    """(config, gpu, number of GPUs, Options, global batch tokens) from a request body. `calibrate`
    names a run under `runs_root` (--runs), never a path: nothing else on disk is read."""
    if not isinstance(body, dict):
        raise BadRequest("request: expected a JSON object")
    for k in body:
        if not isinstance(k, str) or (k not in FLAGS and k not in CONFIG_KEYS):
            raise BadRequest(f"{k}: unknown input", None)
    cfg = C.Config()
    for k, v in body.items():
        if k not in CONFIG_KEYS or (not layout and k.startswith(SEARCHED)):
            continue
        if _blank(v):  # blank means "the preset's" only where the config has no value of its own
            if _get(cfg, k) is not None:
                raise BadRequest(f"{k}: required, got a blank value", k)
            continue
        listed = isinstance(v, list) and isinstance(_get(cfg, k), list)  # parallel.pp_layers: config.apply checks it
        if not listed and not isinstance(v, (str, int, float, bool)):
            raise BadRequest(f"{k}: expected a value, got {type(v).__name__}", k)
        # booleans as text, so that an integer key refuses `true` as the command line does
        C.apply(cfg, k, ("true" if v else "false") if isinstance(v, bool) else v)
    n = _number(body, "gpus", int, 1, 1)
    if n > MAX_GPUS:
        raise BadRequest(f"gpus: at most {MAX_GPUS}, got {n}", "gpus")
    hw = {k: _number(body, k, int if k == "gpus_per_node" else float) for k in FLAG_FIELDS}
    gpu, n = _device(body, n, hw)
    eff = _number(body, "efficiency", float, Options.efficiency)
    ceff = _number(body, "comm_efficiency", float, Options.comm_efficiency)
    if (eff is not None and not 0 < eff <= 1) or not 0 < ceff <= 1:
        raise BadRequest("efficiency: --efficiency / --comm-efficiency must be in (0, 1]", "efficiency")
    flash = body.get("flash", True)
    if not isinstance(flash, bool):
        raise BadRequest(f"flash: expected true/false, got {flash!r}", "flash")
    kernel = str(body.get("attn_kernel") or Options.attn_kernel)
    if kernel not in KERNELS:
        raise BadRequest(f"attn_kernel: expected one of {', '.join(KERNELS)}, got {kernel!r}", "attn_kernel")
    cal = None
    if body.get("calibrate"):  # a run under --runs: the machine it measured replaces the GPU profile
        from ..plan.calibrate.fit import fit
        try:
            if runs_root is None:
                raise BadRequest("calibrate: no runs root to read runs from", "calibrate")
            path = run_path(runs_root, body["calibrate"])
            cal = fit(path)
        except (BadRequest, NotFound) as e:
            raise BadRequest("calibrate: " + str(e).removeprefix("run: "), "calibrate") from None
        except PlanError as e:
            raise BadRequest(str(e).replace(os.path.dirname(path) + os.sep, "").replace("--calibrate", "calibrate", 1),
                             "calibrate") from None
    cfg = priced_on(cfg, gpu=cal is None or cal.card is not None)  # training.precision / compile "auto"
    opts = Options(efficiency=eff, comm_efficiency=ceff, flash=flash, compiled=bool(cfg.training.compile),
                   attn_kernel=kernel)
    if cal is not None:
        from ..plan.calibrate.fit import device_and_options
        gpu, opts = device_and_options(cal, n, bool(cfg.training.compile))
    seq = cfg.data.seq_len
    if seq < 1:
        raise BadRequest(f"data.seq_len: must be >= 1, got {seq}", "data.seq_len")
    tokens = _number(body, "global_batch_tokens", int, 2 ** 22, 1)
    if tokens % seq:
        raise BadRequest(f"global_batch_tokens: {tokens} is not a multiple of data.seq_len {seq}",
                         "global_batch_tokens")
    cfg.training.global_batch = tokens // seq
    return cfg, gpu, n, opts, tokens


def _device(body: dict, n: int, hw: dict):
    """(the GPU profile, or a mixed Cluster for `gpu` = "h100:8,a100-80gb:8"; the number of GPUs): a
    mixed cluster gives the count itself, and a `gpus` that disagrees is refused naming gpus."""
    name = str(body.get("gpu") or "h100")
    if not is_mixed_flag(name):
        return get_gpu(name, **hw), n
    if body.get("calibrate"):
        raise BadRequest("calibrate: a mixed cluster is priced from the device profiles", "calibrate")
    cluster = parse_cluster(name.split(","), key="gpu", **hw)
    if not _blank(body.get("gpus")):
        check_world(cluster, n, "gpus")
    if cluster.world > MAX_GPUS:
        raise BadRequest(f"gpu: at most {MAX_GPUS} GPUs, got {cluster.world}", "gpu")
    g = cluster.groups[0]
    return (cluster if cluster.mixed else g.gpu), cluster.world


def _jsonable(x):
    """The estimate exactly as `meshlm estimate --json` prints it (same float round trip)."""
    return json.loads(json.dumps(x))


# ---------------------------------------------------------------------------------- endpoints

def run_estimate(body, runs_root: str | None = None) -> dict:
    """POST /api/estimate: the estimate of the layout the inputs describe, its pipeline timeline and the
    TOML that trains it."""
    try:
        cfg, gpu, n, opts, _ = parse(body, runs_root=runs_root)
        check_course(cfg)
        shape = shape_from_config(cfg)
        if isinstance(gpu, Cluster):  # a mixed cluster: each stage or replica on its own card
            cfg.parallel.devices = gpu.items()
            mixed = _jsonable(estimate_mixed(shape, cfg, gpu, opts))
            return {"mixed": mixed, "pipeline": None, "toml": C.to_toml(cfg), "course": sample_course(cfg),
                    "run": mixed_run_total(cfg, mixed["step_s"])}
        spec = spec_from_config(cfg, n)
        out = estimate(shape, spec, gpu, opts)
        run = run_total(cfg, shape, spec, gpu, opts, out["step_s"]) if "step_s" in out else None
        energy = priced(out, power_of(gpu), gpu.gpus_per_node, Site(), run["seconds"]) if run else None
        if energy is not None:  # as `meshlm estimate` prices it (plan/cost/energy.py)
            out["energy"] = energy
    except BadRequest:
        raise
    except (C.ConfigError, PlanError, HardwareError) as e:
        raise BadRequest(str(e)) from None
    return {"estimate": _jsonable(out), "pipeline": simulated_timeline(out, spec),
            "derived": {"dp": spec.dp, "microbatches": spec.accum, "zero_group": spec.zero_group,
                        "global_batch": spec.global_batch, "gpus": n},
            "toml": C.to_toml(to_config(shape, spec, cfg)), "course": sample_course(cfg), "run": _jsonable(run)}


def run_plan(body, runs_root: str | None = None) -> dict:
    """POST /api/plan: `meshlm plan` for the inputs' model and cluster (their layout keys are ignored)."""
    try:
        cfg, gpu, n, opts, tokens = parse(body, layout=False, runs_root=runs_root)
        top = _number(body, "top", int, 10, 1)
        shape = shape_from_config(cfg)
        if isinstance(gpu, Cluster):
            return _plan_mixed(shape, cfg, gpu, opts, tokens, min(top, 50))
        res = plan(shape, gpu, n, cfg.data.seq_len, tokens, cfg.training.precision, min(top, 50), {}, opts,
                   optim=cfg.optim.name, knobs=search_knobs(cfg))
    except BadRequest:
        raise
    except (C.ConfigError, PlanError, HardwareError) as e:
        raise BadRequest(str(e)) from None
    rows = []
    price_rows(res.ranked, power_of(gpu), gpu, Site())  # J/token at the defaults of `meshlm plan`
    for r in res.ranked:
        row_cfg = to_config(shape, spec_of_layout(r["layout"]), cfg)
        rows.append({"layout": r["layout"], "step_s": r["step_s"], "mfu": r["mfu"],
                     "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "per_gpu_total": r["per_gpu"]["total"],
                     "j_per_token": r["j_per_token"], "inputs": layout_inputs(row_cfg), "toml": C.to_toml(row_cfg)})
    priced = [r for r in rows if r["j_per_token"] is not None]
    front = [rows.index(priced[i]) for i in pareto_front(priced)]  # the time-energy front of the rows (docs/energy.md)
    return {"ranked": rows, "counts": dict(res.counts), "reasons": dict(res.reasons.most_common(8)),
            "elapsed_s": res.elapsed_s, "global_batch": res.global_batch, "pareto": front}


def _plan_mixed(shape, cfg, cluster, opts, tokens: int, top: int) -> dict:
    """POST /api/plan on a mixed cluster: `meshlm plan --gpu TYPE:COUNT,... --json`'s rows, each with the
    TOML that trains it (parallel.devices and the planner's pp_layers or dp_weights)."""
    res = plan_mixed(shape, cluster, cfg.data.seq_len, tokens, cfg.training.precision, top, {}, opts,
                     cfg.optim.name, search_knobs(cfg))
    rows = []
    for p in res.ranked:  # `inputs`: the layout keys that load the row (dp_weights or pp_layers included)
        row_cfg = mixed_config(shape, p, cluster, cfg)
        rows.append(dict(_jsonable(row(p, shape, cluster)), toml=C.to_toml(row_cfg),
                         inputs=layout_inputs(row_cfg)))
    return {"mixed": True, "ranked": rows, "comparison": _jsonable(comparison(res)), "counts": dict(res.counts),
            "elapsed_s": res.elapsed_s, "global_batch": res.global_batch}


def timeline_json(tl, source: str) -> dict:
    """A simulate.Timeline (simulated or measured) as drawable rows of [start, end, kind, mb, chunk]."""
    return {"p": tl.p, "m": tl.m, "v": tl.v, "makespan": tl.makespan, "bubble": tl.bubble, "name": tl.name,
            "source": source, "rows": [[[s, e, a.kind, a.mb, a.chunk] for s, e, a in row] for row in tl.rows]}


def simulated_timeline(out: dict, spec) -> dict | None:
    """The chosen schedule through the simulator, with the planner's own per-micro-batch costs (the
    F, B, W it uses for the bubble in plan/cost/estimate.py: exposed communication and the compute slowed
    beside hidden communication split over F and B)."""
    if not spec.pp_enabled or "time" not in out:
        return None
    p, m, v = spec.pp, spec.accum, spec.pp_virtual
    if spec.pp_schedule not in SIMULATED:
        return {"skipped": f"parallel.pp_schedule: {spec.pp_schedule} has no simulator yet (bubble from the formula)"}
    if p * m * v > MAX_TIMELINE_UNITS:
        return {"skipped": f"pp·microbatches·virtual = {p * m * v} actions per rank pair is too many to draw "
                           f"(bubble from the {out['time']['bubble_source']})"}
    t = out["time"]
    x = (t["exposed_comm_microbatch_s"] + t["overlap_microbatch_s"]) / m  # as time_model prices the slot
    f = t["forward_s"] / m + x / 2
    b = (t["backward_s"] + t["recompute_s"]) / m + x / 2
    w = min(t["backward_s"] / m / 2, b)
    tl = schedule_timeline(spec.pp_schedule, p, m, v, f, b, w, name=spec.pp_schedule)
    return timeline_json(tl, "simulator")
