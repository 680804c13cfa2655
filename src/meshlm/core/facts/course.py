"""The run's course over its steps: the learning-rate schedule (optim.schedule, WSD's decay, an anneal
from a checkpoint) and the batch-size ramp (training.batch_rampup). Their checks live here, beside
sections.py's keys, because both are functions of the step and the config only (docs/training.md)."""
from __future__ import annotations

import math

from ..choices import DECAY_TYPES, LR_SCHEDULES
from ..errors import ConfigError, check_choice

# (the sections are not imported, not even for their types: sections.py imports this module)


def check_schedule(o, cfg) -> None:
    """optim.schedule and its keys; an anneal (optim.anneal_steps) is settled by preflight.py, which
    reads the checkpoint's step and rewrites the run as a WSD whose decay is its last anneal_steps steps."""
    check_choice(o.schedule, LR_SCHEDULES, "optim.schedule")
    check_choice(o.decay_type, DECAY_TYPES, "optim.decay_type")
    if o.warmup < 0:
        raise ConfigError(f"optim.warmup: must be >= 0, got {o.warmup}")
    if not o.decay_steps >= 0 or o.decay_steps > 1 and not float(o.decay_steps).is_integer():
        raise ConfigError(f"optim.decay_steps: expected a whole number of steps >= 1 or a fraction in (0, 1) of "
                          f"training.steps, got {o.decay_steps}")
    if o.anneal_steps < 0:
        raise ConfigError(f"optim.anneal_steps: must be >= 0 (0 = no anneal), got {o.anneal_steps}")
    if o.anneal_steps:
        if cfg.checkpoint.resume in ("auto", "never"):
            raise ConfigError("optim.anneal_steps: an anneal starts from a checkpoint: give --checkpoint.resume PATH")
        if o.schedule not in ("wsd", "constant"):
            raise ConfigError(f"optim.anneal_steps: anneals a run whose rate is flat (optim.schedule wsd or constant), "
                              f"not {o.schedule}")
        return  # training.steps and the decay are derived from the checkpoint (preflight.settle_anneal)
    if o.decay_steps and o.schedule != "wsd":
        raise ConfigError(f"optim.decay_steps: only optim.schedule = wsd has a decay phase (schedule is {o.schedule})")
    steps = cfg.training.steps
    if o.schedule == "wsd" and steps:
        span = decay_span(o, steps)
        if span > steps - o.warmup:
            raise ConfigError(f"optim.decay_steps: the decay ({span} steps) is longer than the steps after warmup "
                              f"({steps} - {o.warmup} = {steps - o.warmup})")


def decay_span(o, steps: int) -> int:
    """WSD's decay in steps: optim.decay_steps as a count, or its fraction of `steps` (0: a fifth, which
    matched cosine in Hägele et al. 2024), rounded, at least 1."""
    d = o.decay_steps or 0.2
    return int(d) if d >= 1 else max(1, round(d * steps))


def check_ramp_keys(ramp: list[int], global_batch: int, cfg) -> None:
    """training.batch_rampup's own numbers and what it cannot combine with (whole micro-batches per
    rank need the world size: layout.check_rampup)."""
    if not ramp:
        return
    key = "training.batch_rampup"
    if len(ramp) != 3:
        raise ConfigError(f"{key}: expected [start_sequences, increment, over_sequences], got {ramp}")
    start, inc, over = ramp
    if start < 1:
        raise ConfigError(f"{key}: the start batch must be >= 1 sequence, got {start}")
    if start > global_batch:
        raise ConfigError(f"{key}: the start batch {start} is larger than training.global_batch {global_batch}")
    if inc <= 0:
        raise ConfigError(f"{key}: the increment must be > 0, got {inc}")
    if over < 0:
        raise ConfigError(f"{key}: the ramp's samples must be >= 0, got {over}")
    if (global_batch - start) % inc:
        raise ConfigError(f"{key}: the increment {inc} does not divide training.global_batch - start = "
                          f"{global_batch} - {start} (Megatron's rule: the ramp ends exactly at the global batch)")
    why = {"parallel.elastic = \"replan\" (the planner would pick a batch split the ramp's sizes may not "
           "divide)": cfg.parallel.elastic == "replan",
           "parallel.dp_weights (the uneven split is fixed for one global batch)": bool(cfg.parallel.dp_weights)}
    for reason, on in why.items():
        if on:
            raise ConfigError(f"{key}: not with {reason}")


def lr_at(step: int, cfg, total_steps: int) -> float:
    """The rate of the update at `step` (0-based; `cfg`, the optim section): linear warmup to `lr` over optim.warmup steps, then
    optim.schedule (docs/training.md). A function of the step and the config only, so a resumed,
    resharded or resized run keeps its schedule.
    - cosine: cosine from `lr` to `lr × min_lr_ratio`, reached at step `total_steps` (the run's default);
    - linear: the same span, decreasing linearly (Megatron's `linear`);
    - constant: `lr` to the end;
    - wsd: `lr` until the last `decay_span` steps, then `optim.decay_type` down to the floor, which the
      last step runs at (update k of D has progress k / D)."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        span = decay_span(cfg, total_steps)
        progress = min(1.0, max(0, step - (total_steps - span) + 1) / span)
        return floor + (cfg.lr - floor) * _DECAY[cfg.decay_type](progress)
    span = max(1, total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    if cfg.schedule == "linear":
        return floor + (cfg.lr - floor) * (1.0 - progress)
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# WSD's decay shapes: the fraction of (lr - floor) left at progress p in [0, 1] (torchtitan's names)
_DECAY = {"linear": lambda p: 1.0 - p,
          "sqrt": lambda p: 1.0 - math.sqrt(p),
          "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p))}
