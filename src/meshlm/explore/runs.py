"""The runs dashboard's side of the API: run directories under one root, read-only.

A run is a direct child directory of the root (`--runs`) holding metrics.jsonl or config.toml. Names
come from the client, so they are checked twice: a plain name (no separator, no `..`), and the
resolved path must still lie inside the resolved root (a symlink pointing out is refused). Nothing
else on disk can be named through the API.
"""
from __future__ import annotations

import json
import os

from ..core import config as C
from ..core.layout import from_config
from .api import NAME, BadRequest, NotFound, is_run, run_path, timeline_json


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(step records, eval records). A line being written while we read is skipped, not an error."""
    steps, evals = [], []
    f_path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(f_path):
        return steps, evals
    with open(f_path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            if "loss" in rec:
                steps.append(rec)
            elif "eval_loss" in rec:
                evals.append(rec)
    return steps, evals


def list_runs(root: str) -> dict:
    """GET /api/runs: every run directory under the root, newest first, with its last logged step."""
    out = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if not NAME.match(name) or not os.path.isdir(path) or not is_run(path):
                continue
            try:
                run_path(root, name)
            except (BadRequest, NotFound):
                continue  # e.g. a symlink out of the root
            m = os.path.join(path, "metrics.jsonl")
            mtime = os.path.getmtime(m if os.path.isfile(m) else path)
            steps, _ = read_metrics(path)
            last = steps[-1] if steps else {}
            out.append({"name": name, "mtime": mtime, "steps": len(steps), "last_step": last.get("step"),
                        "loss": last.get("loss")})
    out.sort(key=lambda r: -r["mtime"])
    return {"root": os.path.abspath(root), "runs": out}


def world_size(path: str, cfg: C.Config) -> tuple[int, str]:
    """(ranks the run used, how we know). config.toml keeps dp = -1 when dp was left to the launcher;
    then torchrun's per-rank log folders (`logs/<id>/attempt_N/<rank>/`) tell, else one process."""
    if cfg.parallel.dp > 0:
        return from_config(cfg).world_size, "config.toml"
    ranks = 0
    for dirpath, dirnames, _ in os.walk(os.path.join(path, "logs")):
        if os.path.basename(dirpath).startswith("attempt_"):
            ranks = max(ranks, sum(d.isdigit() for d in dirnames))
    if ranks:
        return ranks, "logs/ (one folder per rank)"
    return from_config(cfg).world_size, "one process per pp×cp×tp (no logs/ folder)"


def predict(path: str) -> dict:
    """The planner's memory for rank 0 (the first pipeline stage) under the run's own config and world
    size, to show next to what the run measured on rank 0."""
    from ..plan.cost.memory import stage_memory
    from ..plan.cost.options import Options
    from ..plan.spec import PlanError, check, shape_from_config, spec_from_config
    try:
        cfg = C.load(os.path.join(path, "config.toml"))
        world, source = world_size(path, cfg)
        shape = shape_from_config(cfg)
        spec = spec_from_config(cfg, world)
        check(shape, spec)
        stage = "first" if spec.pp_enabled else "only"
        mem = stage_memory(shape, spec, stage, Options(compiled=bool(cfg.training.compile))).breakdown()
    except (C.ConfigError, PlanError, ValueError, OSError) as e:
        return {"error": str(e).splitlines()[0]}
    return {"world": world, "world_source": source, "stage": stage, "layout": spec.layout_dict(),
            "per_gpu": {k: mem[k] for k in ("params", "grads", "optim", "activations", "buffers", "total")}}


def read_run(root: str, name) -> dict:
    """GET /api/run?name=NAME: metrics, config, the planner's prediction and the pipeline timeline."""
    path = run_path(root, name)
    steps, evals = read_metrics(path)
    cfg_path = os.path.join(path, "config.toml")
    config_text = open(cfg_path).read() if os.path.isfile(cfg_path) else ""
    from ..core.facts.incidents import incidents
    out = {"name": name, "steps": steps, "evals": evals, "config_text": config_text,
           "incidents": [line.removeprefix("meshlm: ") for line in incidents(path)],
           "prediction": predict(path) if config_text else {"error": "no config.toml"}, "pipeline": None}
    trace = os.path.join(path, "pipeline_trace.json")
    if os.path.isfile(trace):
        from ..core.schedule.trace import load_timeline
        try:
            tl, _ = load_timeline(trace)
            out["pipeline"] = timeline_json(tl, "measured")
        except (ValueError, KeyError, OSError) as e:  # being rewritten right now: next refresh
            out["pipeline"] = {"skipped": f"pipeline_trace.json: {str(e).splitlines()[0] if str(e) else type(e).__name__}"}
    return out
