"""The clock plan of a pipeline layout (the Perseus / EnvPipe idea, docs/energy.md "Predicted energy and
the Pareto front"): a relative SM clock per pipeline rank such that the ranks off the critical path run
slower, filling the time they would wait with slower compute that draws less, within a slowdown bound.

Priced with the planner's own simulator (core/schedule/simulate.py with each rank's costs, as
plan/cost/stages.py sizes each rank) and core/facts/power.py's power against the clock. A rank's compute
takes 1/clock as long (memory-bound kernels slow less: the bound is kept conservatively); its exposed
per-micro-batch communication does not change. meshlm never applies clocks: the plan is data.
"""
from __future__ import annotations

from ...core.facts.power import LOWEST_CLOCK, VOLTAGE_FLOOR, Power, clock_power
from ..hardware import GPU
from ..spec import Shape, Spec
from .estimate import SIM_MAX_UNITS, SIMULATED, built_schedule, stage_time
from .options import Options
from .stages import every_rank

STEP = 0.01  # the clock grid the plan is chosen on


def _rank_costs(shape: Shape, s: Spec, gpu: GPU, o: Options) -> list[tuple[float, float, float]]:
    """(compute F + B + recompute, exposed communication, F share of compute, W share) per micro-batch of
    each pipeline rank, as estimate.time_model splits its slowest stage."""
    out = []
    for role in every_rank(s.pp):
        t = stage_time(shape, s, role, gpu, o)
        comp = t["t_f"] + t["t_b"] + t["t_rc"]
        x = (t["exposed_mb"] + t["overlap_mb"]) / s.accum
        out.append((comp, x, t["t_f"] / comp if comp else 0.0, t["t_b"] / 2 / comp if comp else 0.0))
    return out


def _timeline(s: Spec, costs: list, clocks: list[float]) -> float:
    """The simulated makespan of the pipeline phase with each rank's compute at its clock."""
    from ...core.schedule import simulate
    from ...core.schedule.schedules import V_SHAPED
    fbw = []
    for (comp, x, f_share, w_share), c in zip(costs, clocks):
        t = comp / c
        fbw.append((t * f_share + x / 2, t * (1 - f_share) + x / 2, min(t * w_share, t * (1 - f_share) + x / 2)))
    p, m, v = s.pp, s.accum, s.pp_virtual
    vs = s.pp_schedule in V_SHAPED
    worst = max(fbw, key=lambda c: c[0] + c[1])
    acts = built_schedule(s.pp_schedule, p, m, v, tuple(round(c, 12) for c in worst) if vs else None)
    return simulate(acts, p, m, v, cost_f=worst[0], cost_b=worst[1], cost_w=worst[2], vshape=vs,
                    rank_costs=fbw).makespan


def _energy(s: Spec, costs: list, clocks: list[float], span: float, power: Power) -> float:
    """GPU joules of one pipeline's ranks over `span` seconds: compute at its clock's draw, exposed
    communication at the communication figure, the rest of the span at idle."""
    total = 0.0
    for (comp, x, _, _), c in zip(costs, clocks):
        busy, comm = s.accum * comp / c, s.accum * x
        total += busy * clock_power(power, c) + comm * power.comm_w + max(0.0, span - busy - comm) * power.idle_w
    return total


def clock_plan(shape: Shape, s: Spec, gpu: GPU, o: Options, power: Power, max_slowdown: float) -> dict | None:
    """{clocks (one per pipeline rank), slowdown, saving_j (per step, the whole job), saving (of the
    pipeline phase's GPU energy)}; None for a layout without a pipeline or too large to simulate. Ranks
    with the most slack are slowed first, each to the lowest clock on the grid that keeps the makespan
    within the bound, never below the voltage floor (under it the draw falls only as f, and a slower
    compute then costs more idle energy elsewhere than it saves)."""
    if s.pp <= 1 or s.pp_schedule not in SIMULATED or s.pp * s.accum * s.pp_virtual > SIM_MAX_UNITS:
        return None
    costs = _rank_costs(shape, s, gpu, o)
    clocks = [1.0] * s.pp
    base = _timeline(s, costs, clocks)
    bound = base * (1 + max_slowdown)
    floor = max(LOWEST_CLOCK, VOLTAGE_FLOOR)
    for r in sorted(range(s.pp), key=lambda i: costs[i][0]):
        lo, hi = 0, int(round((1.0 - floor) / STEP))  # steps below full clock: the most that still fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            trial = clocks[:r] + [round(1.0 - mid * STEP, 4)] + clocks[r + 1:]
            if _timeline(s, costs, trial) <= bound:
                lo = mid
            else:
                hi = mid - 1
        clocks[r] = round(1.0 - lo * STEP, 4)
    span = _timeline(s, costs, clocks)
    e0, e1 = _energy(s, costs, [1.0] * s.pp, base, power), _energy(s, costs, clocks, span, power)
    replicas = s.world_size // s.pp
    return {"clocks": clocks, "max_slowdown": max_slowdown, "slowdown": span / base - 1 if base else 0.0,
            "pipeline_s": base, "saving_j": (e0 - e1) * replicas, "saving": (e0 - e1) / e0 if e0 else 0.0}


def describe(plan: dict, j_per_step: float | None = None) -> str:
    """The clock plan's line for `meshlm plan`."""
    share = f", {plan['saving_j'] / j_per_step:.1%} of the step's energy at the wall" if j_per_step else ""
    return (f"clock plan (relative SM clock per pipeline rank, within {plan['max_slowdown']:.1%} slowdown): "
            f"{', '.join(f'{c:.2f}' for c in plan['clocks'])}; pipeline {plan['slowdown']:+.2%} time, "
            f"{plan['saving']:.1%} less GPU energy in it ({plan['saving_j'] / 1e3:,.1f} kJ/step{share})")
