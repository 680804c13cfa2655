"""A layout's energy, priced from what its estimate already computes (docs/energy.md, "Predicted energy
and the Pareto front"): each second of the step by category (estimate.step_categories) at the power
the card draws doing that (core/facts/power.py), plus the hosts' draw, times the facility's PUE.

Every GPU is priced as the estimate's slowest stage (the one whose categories add up to the step):
ranks of a lighter stage wait more and draw less, so a pipeline's energy is slightly over-priced.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ...core.facts import power as P
from ..hardware import GPU, PROFILES
from ..spec import PlanError
from .estimate import step_categories

# which figure each step category (estimate.CATEGORIES) draws: compute-bound kernels and compute beside
# an overlapped collective at busy power, memory-bound kernels at memory power, an exposed collective at
# communication power, and the time the card waits (bubbles, host dispatch, per-step host work) at idle
DRAWS = {"gemm": "busy", "attention": "busy", "recompute": "busy", "compute": "busy", "overlap": "busy",
         "elementwise": "memory", "grad_accum": "memory", "loss": "memory", "optimizer": "memory",
         "comm": "comm", "bubble": "idle", "launch": "idle", "overhead": "idle",
         # plan/cost/scale.py's terms: a collective's hop latencies (links busy, SMs waiting) and the wait for
         # the slowest rank (the others idle)
         "depth": "comm", "straggler": "idle"}
JOULES_PER_KWH = 3.6e6


@dataclass(frozen=True)
class Site:
    """What the facility adds and charges: the hosts' draw per node, the PUE, the price per kWh and the
    grid's carbon intensity (gCO2e/kWh); None: not priced."""
    host_w: float = P.HOST_W_PER_NODE
    pue: float = P.PUE
    price: float | None = None
    carbon: float | None = None


def card_of(gpu: GPU) -> str | None:
    """The profile key of a GPU (a calibrated card keeps its profile's name)."""
    return next((k for k, g in PROFILES.items() if g.name == gpu.name), None)


def power_of(gpu: GPU | None) -> P.Power | None:
    return None if gpu is None else P.card_power(card_of(gpu) or "")


def price(r: dict, power: P.Power, gpus_per_node: int, site: Site = Site()) -> dict:
    """Joules per step (the whole job, at the wall: GPUs and hosts, times PUE) and per token of an
    estimate `r` that has a time model (`step_s`)."""
    cats = step_categories(r)
    watts = {"busy": power.busy_w, "memory": power.memory_w, "comm": power.comm_w, "idle": power.idle_w}
    gpus, step = r["gpus"], r["step_s"]
    per_gpu = {k: v * watts[DRAWS[k]] for k, v in cats.items()}
    gpu_j = gpus * sum(per_gpu.values())
    host_j = math.ceil(gpus / gpus_per_node) * site.host_w * step
    j_step = (gpu_j + host_j) * site.pue
    tokens = r["tokens_per_s_per_gpu"] * step * gpus
    return {"j_per_step": j_step, "j_per_token": j_step / tokens, "gpu_w": gpu_j / gpus / step if step else 0.0,
            "host_w_per_node": site.host_w, "pue": site.pue, "gpu_j": gpu_j, "host_j": host_j,
            "by_category_j": {k: gpus * v * site.pue for k, v in per_gpu.items()}}


def run_energy(e: dict, step_s: float, run_seconds: float, site: Site) -> dict:
    """The run's kWh at the step's mean draw, and its cost and emissions where a price / intensity is given."""
    kwh = e["j_per_step"] / step_s * run_seconds / JOULES_PER_KWH if step_s else 0.0
    return {"kwh": kwh, "price_per_kwh": site.price, "cost": None if site.price is None else kwh * site.price,
            "carbon_g_per_kwh": site.carbon,
            "kg_co2e": None if site.carbon is None else kwh * site.carbon / 1000}


def describe(e: dict) -> str:
    """`meshlm estimate`'s energy line."""
    line = (f"energy: {e['j_per_step'] / 1e3:,.1f} kJ/step, {e['j_per_token']:.3f} J/token (GPU {e['gpu_w']:.0f} W "
            f"mean, host {e['host_w_per_node']:.0f} W/node, PUE {e['pue']:g})")
    run = e.get("run")
    if run:
        line += f"; run {run['kwh']:,.1f} kWh"
        if run["cost"] is not None:
            line += f", cost {run['cost']:,.2f} (at {run['price_per_kwh']:g}/kWh)"
        if run["kg_co2e"] is not None:
            line += f", {run['kg_co2e']:,.1f} kgCO2e (at {run['carbon_g_per_kwh']:g} g/kWh)"
    return line + (f"\n  {e['source']}" if e.get("source") else "")


def add_flags(p: argparse.ArgumentParser, prices: bool) -> None:
    g = p.add_argument_group("energy (plan/cost/energy.py; docs/energy.md)")
    g.add_argument("--pue", type=float, default=P.PUE, help="facility power usage effectiveness, >= 1 (default %(default)s)")
    g.add_argument("--host-w", type=float, default=P.HOST_W_PER_NODE,
                   help="host draw per node besides its GPUs, W (default %(default)s)")
    if prices:
        g.add_argument("--energy-price", type=float, help="price per kWh: print the run's cost")
        g.add_argument("--carbon-intensity", type=float, help="grid gCO2e per kWh: print the run's emissions")


def site_of(args) -> Site:
    """The flags as a Site; a bad value is a one-line PlanError."""
    price_, carbon = getattr(args, "energy_price", None), getattr(args, "carbon_intensity", None)
    if args.pue < 1:
        raise PlanError(f"--pue: must be >= 1 (total facility power over IT power), got {args.pue:g}")
    if args.host_w < 0:
        raise PlanError(f"--host-w: must be >= 0, got {args.host_w:g}")
    for flag, v in (("--energy-price", price_), ("--carbon-intensity", carbon)):
        if v is not None and (v < 0 or not math.isfinite(v)):
            raise PlanError(f"{flag}: must be >= 0, got {v:g}")
    return Site(args.host_w, args.pue, price_, carbon)


def priced(r: dict, power: P.Power | None, gpus_per_node: int, site: Site, run_seconds: float) -> dict | None:
    """`meshlm estimate`'s energy block (price and the run's kWh), or None without a time model or figures."""
    if power is None or "step_s" not in r:
        return None
    e = price(r, power, gpus_per_node, site)
    e["run"] = run_energy(e, r["step_s"], run_seconds, site)
    return e
