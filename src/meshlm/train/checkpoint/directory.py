"""A run's checkpoint directory: the committed steps, which one a run resumes from, and the checks made
before any worker starts (the checkpoint to resume is readable and fits the model; the disk has room)."""
from __future__ import annotations

import json
import os
import re
import shutil

import torch

from .index import CheckpointError, check_files, check_shapes, read_metadata

STEP_DIR = re.compile(r"^step_(\d{8})$")


# -- finding checkpoints ---------------------------------------------------------------------------
def list_checkpoints(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "meta.json")):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def find_resume(root: str, resume: str, restarts: int = 0) -> str | None:
    """The checkpoint to start from: newest complete one for `auto`, none for `never`, else the given
    path (a complete checkpoint: never a `.tmp` being written or left by a crash). After a restart
    (`restarts`: the job's agreed count, docs/fault_tolerance.md) the run's newest checkpoint, if it
    has one, beats `checkpoint.resume`."""
    if restarts > 0 and list_checkpoints(root):
        resume = "auto"
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1][1] if found else None
    if resume.rstrip("/").endswith(".tmp"):
        raise CheckpointError(f"checkpoint.resume: {resume} is an incomplete checkpoint (.tmp); "
                              f"point at a step_NNNNNNNN directory")
    if not os.path.isfile(os.path.join(resume, "meta.json")):
        raise CheckpointError(f"checkpoint.resume: no checkpoint at {resume}")
    return resume


def meta_of(path: str) -> dict:
    """The checkpoint's meta.json, or a CheckpointError naming it."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read meta.json ({e})") from None


def islands_of(path: str) -> int:
    """The DiLoCo island count that wrote the checkpoint at `path` (1: an ordinary run)."""
    return int((meta_of(path).get("layout") or {}).get("islands", 1))


def check_islands(cfg, path: str) -> None:
    """A checkpoint of N islands resumes with any number M > 1 of them (docs/diloco.md, "Checkpoints":
    islands below N keep their own state, θ_outer and its momentum go on, islands from N up join from
    θ_outer: an island dropped or rejoining), and from one island (θ_outer starts as its masters). Into
    one island (no outer step left) only right after an outer sync of the whole model (fragments = 1,
    step divisible by H; with training.outer.delay τ, τ steps after it and alpha 0), where every island
    holds θ_outer. Anything else: one line."""
    meta = meta_of(path)
    written, now = islands_of(path), cfg.parallel.islands
    if written == now or written == 1 or now > 1:
        return
    outer = (meta.get("config") or {}).get("training", {}).get("outer", {})
    h, k, step = int(outer.get("sync_every", 1)), int(outer.get("fragments", 1)), int(meta.get("step", 0))
    delay, alpha = int(outer.get("delay", 0)), float(outer.get("alpha", 0.0))  # a delayed sync lands τ steps late
    landed = step - delay  # the step whose sync landed last, if one landed at `step`
    if k != 1 or landed % h or (delay and landed < h) or alpha or meta.get("outer_pending"):
        raise CheckpointError(f"parallel.islands: {path} was written by {written} islands at step {step}, inside "
                              f"an outer round (training.outer.sync_every {h}, fragments {k}), where the islands' "
                              f"models differ; resume it with parallel.islands > 1, or in one island from a "
                              f"checkpoint right after a whole-model outer sync (fragments = 1, a step divisible "
                              f"by {h})")


def preflight(cfg, run_dir: str, restarts: int = 0) -> None:
    """Refuse the checkpoint a run would resume from before any worker starts: a `.tmp`, a missing or
    unreadable index, a truncated data file, or tensors whose shapes differ from the configured model
    (the first mismatching one, in model order, is named). After a restart (`restarts`) that is the
    newest checkpoint of the run, whatever `checkpoint.resume` says (`find_resume`)."""
    path = find_resume(os.path.join(run_dir, "checkpoints"), cfg.checkpoint.resume, restarts)
    if path is None:
        return
    try:
        with open(os.path.join(path, "meta.json")) as f:
            weights_only = bool(json.load(f).get("weights_only"))
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read meta.json ({e})") from None
    if weights_only:  # `meshlm convert --from-hf` output: no optimizer state to resume
        raise CheckpointError(f"checkpoint.resume: {path} holds weights only (meshlm convert --from-hf); "
                              f"train from Hugging Face weights with --model.init_from hf:DIR")
    check_islands(cfg, path)
    from ...model import build_model
    from ...core.config.model import model_args
    from ...model.init import canonical_name

    with torch.device("meta"):
        model = build_model(model_args(cfg))
    named = [(canonical_name(n), tuple(p.shape)) for n, p in model.named_parameters()]
    shapes = {f"{kind}/{n}": s for kind in ("master", "exp_avg", "exp_avg_sq") for n, s in named}
    md = read_metadata(path)
    check_shapes(path, md, shapes)
    check_files(path, md)


def check_room(cfg, run_dir: str) -> None:
    """Refuse, in one line, a run whose checkpoint directory cannot hold `keep + 1` checkpoints (the
    newest kept ones and the one being written; with keep = 0, every save the run makes) plus its
    Hugging Face exports. A checkpoint's size is the planner's (fp32 masters and Adam moments,
    plan/cost/goodput.py); checkpoints already in the directory count as room the run has."""
    c, t = cfg.checkpoint, cfg.training
    if not c.every and c.export_hf == "":
        return
    from ...core.choices import DTYPE_BYTES
    from ...core.config.model import model_args
    from ...core.facts.checkpoint import checkpoint_bytes
    params = model_args(cfg).num_params()
    size = checkpoint_bytes(params)
    every = c.every if isinstance(c.every, int) and c.every > 0 else 0
    count = c.keep + 1 if c.keep > 0 else max(1, t.steps // every if every else 1)
    exports = 0 if c.export_hf == "" else 1 if c.export_hf == "end" else -(-t.steps // int(c.export_hf))
    root = os.path.join(run_dir, "checkpoints")
    have = sum(dir_bytes(p) for _, p in list_checkpoints(root))
    need = max(count * size - have, size) + exports * params * DTYPE_BYTES[c.export_dtype]
    free = free_bytes(root)
    if free < need:
        what = f"{count} checkpoints of {size:,} bytes" + (f" and {exports} export(s)" if exports else "")
        raise CheckpointError(f"checkpoint: {existing_dir(root)} has {free:,} bytes free, the run needs {need:,} "
                              f"({what}; checkpoint.keep = {c.keep}): free space or lower checkpoint.keep")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def existing_dir(path: str) -> str:
    """`path`, or its nearest ancestor that exists (where its files will go; for a free-space check)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    return shutil.disk_usage(existing_dir(path)).free
