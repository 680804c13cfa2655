"""What `meshlm plan --objective` ranks by: step time (the search's own order), joules per token, or the
time-energy Pareto front (docs/energy.md, "Predicted energy and the Pareto front").

The search keeps the fastest layouts it has timed (plan/search/ranked.py); for energy and the front it
keeps ENERGY_KEEP of them and prices each one's energy in full. A layout outside them is slower than
every kept one, so it cannot dominate a kept layout: the front shown is exact over the layouts no
slower than the slowest kept, and the least J/token is the least among those.
"""
from __future__ import annotations

from ..cost.energy import Site, price
from ..hardware import GPU

OBJECTIVES = ("time", "energy", "pareto")
ENERGY_KEEP = 120  # layouts priced in full for energy / pareto (the time objective keeps 3 × --top)


def keep_for(objective: str, top: int) -> int | None:
    """How many of the fastest layouts the search keeps (None: its default, 3 × top)."""
    return None if objective == "time" else max(3 * top, ENERGY_KEEP)


def price_rows(rows: list[dict], power, gpu: GPU, site: Site) -> None:
    """Each estimate gets its `energy` (energy.price) and `j_per_token` (None without figures)."""
    for r in rows:
        e = price(r, power, gpu.gpus_per_node, site) if power is not None else None
        r["energy"] = e
        r["j_per_token"] = None if e is None else e["j_per_token"]


def pareto_front(rows: list[dict]) -> list[int]:
    """Indices of the rows no other row matches or beats on both step time and J/token, by step time; of
    rows equal on both, the first."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["step_s"], rows[i]["j_per_token"], i))
    front, best = [], float("inf")
    for i in order:
        if rows[i]["j_per_token"] < best:
            front.append(i)
            best = rows[i]["j_per_token"]
    return front


def ordering(objective: str, power, gpu: GPU, site: Site):
    """The search's re-ranking of its priced rows (ranked.plan `order`): indices, best first."""
    def order(rows: list[dict]) -> list[int]:
        price_rows(rows, power, gpu, site)
        if objective == "energy":
            return sorted(range(len(rows)), key=lambda i: (rows[i]["j_per_token"], rows[i]["step_s"], i))
        return pareto_front(rows)
    return None if objective == "time" else order


def with_clocks(row: dict, shape, gpu: GPU, o, power, max_slowdown: float) -> dict | None:
    """The clock plan (plan/cost/clocks.py) of a ranked row with a pipeline, kept in the row as `clock_plan`."""
    from ..cost.clocks import clock_plan
    from ..spec import spec_of_layout
    if power is None or row["layout"]["pp"] <= 1:
        return None
    plan_ = clock_plan(shape, spec_of_layout(row["layout"]), gpu, o, power, max_slowdown)
    if plan_ is not None:
        row["clock_plan"] = plan_
    return plan_


def clocks_toml(text: str, clocks: list[float], has_key: bool) -> str:
    """The emitted config with the clock plan as data: set in training.energy.clocks where the config has
    that key, else as a comment block an administrator reads (meshlm never applies clocks)."""
    if has_key:
        return text
    return (text.rstrip("\n") + "\n\n# clock plan (meshlm plan; docs/energy.md): relative SM clock per pipeline stage,\n"
            "# never applied by meshlm\n# training.energy.clocks = [" + ", ".join(f"{c:g}" for c in clocks) + "]\n")


def describe(objective: str, priced: int) -> str:
    """The plan table's line saying what it ranks by."""
    what = ("by predicted J/token (at the wall: GPUs, hosts, PUE)" if objective == "energy" else
            "the time-energy Pareto front: no row is matched or beaten on both step time and J/token")
    return f"ranked {what}, among the {priced} fastest layouts priced in full"
