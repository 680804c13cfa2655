"""The energy flags of `meshlm estimate` and `meshlm plan` (plan/cli.py): their checks, the power figures
(the card's, or fitted to a `--calibrate` run), the plan's objective and its clock plan, the emitted
config's clock data (docs/energy.md, "Predicted energy and the Pareto front")."""
from __future__ import annotations

from ..core import config as C
from .cost import energy as en
from .search import objective as obj
from .spec import PlanError

DEFAULT_SLOWDOWN = 0.01  # the clock plan's bound under --objective energy / pareto


def plan_site(args) -> en.Site:
    """`meshlm plan`'s energy flags checked (one-line PlanError) and the Site they describe."""
    if args.objective not in obj.OBJECTIVES:
        raise PlanError(f"--objective: unknown '{args.objective}' (known: {', '.join(obj.OBJECTIVES)})")
    if args.max_slowdown is not None and not 0 <= args.max_slowdown < 1:
        raise PlanError(f"--max-slowdown: must be in [0, 1), got {args.max_slowdown:g}")
    return en.site_of(args)


def power(args, gpu, cal):
    """(the figures, a line where they came from or None): a --calibrate run's fitted ones where it
    logged energy, else the card's (core/facts/power.py); None for a device without figures."""
    if cal is None:
        return en.power_of(gpu), None
    from .calibrate.power import calibrated_power
    return calibrated_power(args.calibrate, cal, gpu)


def estimate_energy(args, out: dict, gpu, cal, site: en.Site, run_seconds: float) -> None:
    """`meshlm estimate`'s energy block into `out` (nothing without a time model or figures)."""
    figures, note = power(args, gpu, cal)
    e = en.priced(out, figures, gpu.gpus_per_node, site, run_seconds)
    if e is not None:
        out["energy"] = dict(e, source=note) if note else e


def plan_power(args, gpu, cal):
    """The figures a plan ranks with; an energy objective without any is a one-line PlanError."""
    figures = power(args, gpu, cal)[0]
    if figures is None and args.objective != "time":
        raise PlanError(f"--objective {args.objective}: no power figures for {gpu.name} (core/facts/power.py)")
    return figures


def after_search(res, args, shape, gpu, opts, figures, site: en.Site) -> dict | None:
    """Every ranked row's J/token (the objectives price theirs in the search), and the clock plan of the
    row --emit-rank names, under an energy objective or an explicit --max-slowdown."""
    if args.objective == "time":
        obj.price_rows(res.ranked, figures, gpu, site)
    if not res.ranked or (args.objective == "time" and args.max_slowdown is None):
        return None
    row = res.ranked[min(args.emit_rank, len(res.ranked)) - 1]
    bound = DEFAULT_SLOWDOWN if args.max_slowdown is None else args.max_slowdown
    return obj.with_clocks(row, shape, gpu, opts, figures, bound)


def clock_line(clocks: dict, row: dict) -> str:
    from .cost.clocks import describe
    return describe(clocks, row["energy"]["j_per_step"] if row.get("energy") else None)


def emitted_toml(out, clocks: dict | None) -> str:
    """The config --emit-config writes, with the clock plan as data (training.energy.clocks where the
    config has that key, else a comment block: plan/search/objective.py `clocks_toml`)."""
    has_key = hasattr(getattr(out.training, "energy", None), "clocks")
    if clocks is not None and has_key:
        out.training.energy.clocks = clocks["clocks"]
    text = C.to_toml(out)
    return text if clocks is None else obj.clocks_toml(text, clocks["clocks"], has_key)
