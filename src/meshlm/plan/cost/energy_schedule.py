"""The schedule in time, priced (docs/energy.md, "Scheduling in time"): what `meshlm estimate` prints for
a config with a trace: the spans the run would train in and their cost (or emissions) against running
now. The spans are chosen by core/facts/energy_trace.py, the same code the run plans with; the entry's
check predicts the run's step time with plan/search/auto.py `predicted_step_s`."""
from __future__ import annotations

import time

from ...core.facts.energy_trace import Schedule, describe, schedule_for
from .estimate import run_time

DEFAULT_KW = 1.0  # without a predicted draw the cost is per kW of it (the pricing's J/step sets it)


def schedule_lines(cfg, out: dict, shape, spec, gpu, opts, kw: float | None = None, unit: str = "") -> list[str]:
    """`meshlm estimate`'s lines for training.energy.trace (none without one): the run's predicted
    seconds (`out`: the estimate, its `step_s`) spread over the trace's cheapest spans from now.
    `kw`: the job's draw while training (the pricing's prediction; default DEFAULT_KW)."""
    if not cfg.training.energy.trace or "step_s" not in out:
        return []
    run = run_time(shape, spec, gpu, opts, cfg.training.steps, cfg.training.batch_rampup, out["step_s"])
    steps = cfg.training.steps
    sched: Schedule = schedule_for(cfg.training.energy, time.time(), run["seconds"] / max(steps, 1), steps,
                                   kw or DEFAULT_KW)
    return describe(sched, unit, per_kw=kw is None)
