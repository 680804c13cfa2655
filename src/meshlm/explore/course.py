"""The run's course for the explorer's schedule chart: the learning rate and the global batch over the
run's steps, sampled from the trainer's own functions (train/optim.py `lr_at`, core/facts/ramp.py
`BatchRamp`), and the run's total time (plan/cost/estimate.py `run_time`, as `meshlm estimate` prints it).

A run may have a million steps: the chart gets at most `MAX_POINTS` evenly spaced steps plus the
schedule's corners (docs/explore.md, "The schedule"), so the answer and its memory do not grow with
the number of steps.
"""
from __future__ import annotations

from ..core import config as C
from ..core.facts.course import check_ramp_keys
from ..core.facts.ramp import BatchRamp
from ..core.layout import check_rampup
from ..plan.cost.estimate import run_time
from ..core.facts.course import lr_at

MAX_POINTS = 200   # evenly spaced samples of the run; the corners come on top
MAX_LEVELS = 50    # a ramp with at most this many batch sizes also gets each size's first step
# the form's inputs for the course (config keys; none of them changes a layout's price or the search)
COURSE_KEYS = ("training.steps", "optim.schedule", "optim.lr", "optim.warmup", "optim.min_lr_ratio",
               "optim.decay_steps", "optim.decay_type", "training.batch_rampup")


def check_course(cfg) -> None:
    """The config's own checks of the course keys (core/facts/course.py, training.steps), one ConfigError
    line naming the key; run after the global batch is known (the ramp ends at it)."""
    if cfg.training.steps < 1:
        raise C.ConfigError(f"training.steps: the explorer draws a run of >= 1 step, got {cfg.training.steps}")
    C.check_schedule(cfg.optim, cfg)
    check_ramp_keys(cfg.training.batch_rampup, cfg.training.global_batch, cfg)


def corners(cfg, ramp: BatchRamp) -> dict:
    """The steps where the curves bend. warmup_end: the last warmup step (the peak rate); decay_start:
    the first step below the peak (WSD: the decay's first; cosine and linear: right after warmup; none
    for constant); ramp_end: the first step at the full batch (none without a ramp)."""
    o, steps = cfg.optim, cfg.training.steps
    out = {"warmup_end": o.warmup - 1 if o.warmup else None, "decay_start": None,
           "ramp_end": ramp.ramp_steps if ramp.ramp_steps else None}
    if o.schedule == "wsd":
        out["decay_start"] = steps - C.decay_span(o, steps)
    elif o.schedule in ("cosine", "linear"):
        out["decay_start"] = o.warmup
    return {k: v for k, v in out.items() if v is not None and 0 <= v < steps}


def sample_steps(steps: int, bends: list[int], n: int = MAX_POINTS) -> list[int]:
    """At most n evenly spaced steps of [0, steps) with the first and the last, plus each bend and the
    step before it (so a straight segment between samples is the curve's own up to the bend)."""
    grid = set(range(steps)) if steps <= n else {round(i * (steps - 1) / (n - 1)) for i in range(n)}
    extra = {s for b in bends for s in (b - 1, b) if 0 <= s < steps}
    return sorted(grid | extra)


def sample_course(cfg) -> dict:
    """{"step": [...], "lr": [...], "batch": [...] or None (a fixed batch), "corners": {...}} for the
    chart: lr_at and BatchRamp at the sampled steps, exactly as the trainer computes them."""
    steps, t = cfg.training.steps, cfg.training
    ramp = BatchRamp(t.global_batch, t.batch_rampup)
    bends = corners(cfg, ramp)
    levels = [lv.step for lv in ramp.levels] if len(ramp.levels) <= MAX_LEVELS else []
    at = sample_steps(steps, list(bends.values()) + levels)
    return {"step": at, "lr": [lr_at(s, cfg.optim, steps) for s in at],
            "batch": [ramp.batch(s) for s in at] if ramp.ramp_steps else None, "corners": bends}


def run_total(cfg, shape, spec, gpu, opts, step_s: float) -> dict:
    """`meshlm estimate`'s run line as data: run_time over training.steps with the ramp's smaller steps
    priced at their batch (each ramp size split into whole micro-batches: layout.check_rampup)."""
    check_rampup(cfg, spec)
    return run_time(shape, spec, gpu, opts, cfg.training.steps, cfg.training.batch_rampup, step_s)


def mixed_run_total(cfg, step_s: float) -> dict:
    """A mixed cluster's run: steps × the step. A ramp is not priced there (`meshlm estimate` prints no
    run line for a mixed cluster: each ramp size would be another speed split), so it is said, not guessed."""
    t = cfg.training
    if t.batch_rampup:
        return {"skipped": "training.batch_rampup: the ramp's smaller steps are not priced on a mixed cluster"}
    return {"steps": t.steps, "seconds": t.steps * step_s, "tokens": t.steps * t.global_batch * cfg.data.seq_len,
            "ramp_steps": 0, "ramp_extra": 0.0,
            "batches": [{"global_batch": t.global_batch, "steps": t.steps, "step_s": step_s}]}
