"""The power figures fitted to a measured run (`--calibrate RUN_DIR` when its metrics.jsonl carries
energy): docs/energy.md, "Predicted energy and the Pareto front".

One run's mean draw cannot tell four figures apart, so one factor is fitted: the figures above idle are
scaled until the run's own predicted step (its categories at those figures) draws what it measured.
A machine with no figures (a CPU) gets one flat figure: what it measured per rank.
"""
from __future__ import annotations

import json
import os
import statistics

from ...core.facts.power import Power
from ..spec import PlanError


def measured_watts(run_dir: str, warmup: int = 1) -> float | None:
    """The job's mean draw per rank in watts, from the records with energy (`energy_j` since the
    previous record over the `time` between them; `power_w` where no time is logged); None: no energy."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            recs = [json.loads(x) for x in f if x.strip()]
    except (OSError, json.JSONDecodeError):
        return None
    recs = [r for r in recs if "step_s" in r][warmup:]
    world = next((r["world"] for r in reversed(recs) if r.get("world")), None) or 1
    joules = seconds = 0.0
    for prev, r in zip(recs, recs[1:]):
        if r.get("energy_j") is not None and r.get("time") is not None and prev.get("time") is not None:
            joules += r["energy_j"]
            seconds += r["time"] - prev["time"]
    if seconds > 0:
        return joules / seconds / world
    watts = [r["power_w"] for r in recs if r.get("power_w") is not None]
    return statistics.median(watts) / world if watts else None


def fit_power(run_dir: str, base: Power | None, predicted_gpu_w: float | None) -> tuple[Power | None, str | None]:
    """(the figures that reproduce the run's measured draw, a line saying where they came from; None: the
    run logged no energy and the card's own figures stand, as without --calibrate);
    `predicted_gpu_w`: the mean draw per GPU the base figures give the run's own layout (energy.price)."""
    w = measured_watts(run_dir)
    if w is None:
        return base, None
    if base is None or predicted_gpu_w is None:
        return Power(w, w, w, w), f"power: {w:.1f} W per rank at every category, measured by the calibration run"
    above = predicted_gpu_w - base.idle_w
    if above <= 0 or w <= base.idle_w:
        raise PlanError(f"--calibrate: {run_dir} measured {w:.1f} W per GPU, at or below the card's idle "
                        f"{base.idle_w:g} W: cannot fit the figures above idle")
    k = (w - base.idle_w) / above
    return base.scaled(k), (f"power: the card's figures above idle × {k:.3f}, fitted to the calibration "
                            f"run's {w:.1f} W per GPU (predicted {predicted_gpu_w:.1f} W)")


def calibrated_power(run_dir: str, cal, gpu) -> tuple[Power | None, str | None]:
    """fit_power for a `--calibrate` run: the run's own layout is predicted on the calibrated machine
    (fit.predict) and priced with the card's figures, to compare with what it measured."""
    from ..cost.energy import power_of, price
    from .fit import measured, predict, run_config
    base = power_of(gpu)
    pred = None
    if base is not None and measured_watts(run_dir) is not None:
        m = measured(run_dir)
        r = predict(cal, run_config(run_dir), int(m.world or 1))
        pred = price(r, base, gpu.gpus_per_node)["gpu_w"] if "step_s" in r else None
    return fit_power(run_dir, base, pred)
