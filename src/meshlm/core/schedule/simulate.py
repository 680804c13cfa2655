"""Time a schedule with a cost model, to compare schedules before touching GPUs.

Each rank runs its list in order (replay.py); a compute starts when the rank is
free and its inputs exist (forward of stage s-1, backward of stage s+1). A
cross-rank input arrives `cost_comm` after it was produced. The `p2p` mode says
how far p2p batches also block, to price the runtime's choices.

Costs are per micro-batch for a rank's whole share of the model, so with v
chunks each chunk's F costs cost_f / v. A split backward costs
I = cost_b - cost_w and W = cost_w (default cost_w = cost_b / 2).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action
from .check import inflight_profile, match_p2p
from .replay import replay


@dataclass
class Timeline:
    """Simulated run: per-rank (start, end, action) compute spans and summary numbers."""

    p: int
    m: int
    v: int
    rows: list[list[tuple[float, float, Action]]]
    makespan: float
    bubble: float                 # 1 - sum(busy) / (p * makespan)
    peak_inflight: list[int]      # held (mb, chunk) activations, see check.py
    busy: list[float]
    name: str = ""
    costs: dict = field(default_factory=dict)


def action_costs(v: int, cost_f: float = 1.0, cost_b: float = 2.0, cost_w: float | None = None) -> dict:
    """Duration of each compute kind for one chunk."""
    if cost_w is None:
        cost_w = cost_b / 2
    if min(cost_f, cost_b, cost_w) < 0 or cost_w > cost_b:
        raise ValueError(f"need costs >= 0 and cost_w <= cost_b, got f={cost_f} b={cost_b} w={cost_w}")
    return {"F": cost_f / v, "B": cost_b / v, "I": (cost_b - cost_w) / v, "W": cost_w / v}


P2P_MODES = ("free", "blocking")


def simulate(actions: list[list[Action]], p: int, m: int, v: int = 1, cost_f: float = 1.0,
             cost_b: float = 2.0, cost_w: float | None = None, cost_comm: float = 0.0,
             p2p: str = "free", name: str = "", vshape: bool = False,
             rank_costs: list[tuple[float, float, float]] | None = None) -> Timeline:
    """Simulate `actions` (as built by schedules.py) and return its Timeline.

    p2p="free": p2p only carries data (arrives cost_comm after production),
    the textbook assumption. "blocking": every batch is waited on whole
    before the next compute and a send needs its recv posted (the rendezvous
    model check.py proves safe), which is what a runtime pays if it waits
    on every batch_isend_irecv.

    `rank_costs`: (F, B, W) of each rank instead of one for all, when stages are not equally fast (uneven
    `pp_layers`, or cards of different speed: plan/mixed/search.py); the summary `costs` keep cost_f, cost_b.
    """
    dur = action_costs(v, cost_f, cost_b, cost_w)
    if rank_costs is not None:
        if len(rank_costs) != p:
            raise ValueError(f"rank_costs: {len(rank_costs)} entries for {p} ranks")
        dur = [action_costs(v, *c) for c in rank_costs]
    if cost_comm < 0:
        raise ValueError(f"cost_comm must be >= 0, got {cost_comm}")
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p must be one of {P2P_MODES}, got {p2p!r}")
    if p2p != "free":
        match_p2p(actions, p, vshape)  # each SEND pairs with a RECV of the same tensor
    rows = replay(actions, p, v, dur, cost_comm, blocking=p2p != "free", vshape=vshape).spans
    makespan = max((row[-1][1] for row in rows if row), default=0.0)
    busy = [sum(e - s for s, e, _ in row) for row in rows]
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    costs = {"cost_f": cost_f, "cost_b": cost_b, "cost_w": cost_b / 2 if cost_w is None else cost_w,
             "cost_comm": cost_comm, "p2p": p2p}
    return Timeline(p, m, v, rows, makespan, bubble, inflight_profile(actions), busy, name, costs)


def textbook_bubble(name: str, p: int, m: int, v: int = 1, cost_f: float = 1.0, cost_b: float = 2.0,
                    cost_w: float | None = None) -> float:
    """Closed-form bubble fraction from the papers, for comparison with `simulate`.

    gpipe / 1f1b: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1); zb-h1: idle
    (p-1)*(F+I-W) per rank (Qi et al.) against m*(F+B) of work; zbv: the same
    warm-up at half-size chunks, (p-1)*(F+I-W)/2 (our list-scheduled ZB-V reaches
    it for p <= 4 and m >= 2p and stays a little above beyond; docs/pipeline.md).
    """
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name in ("zb-h1", "zbv"):
        w = cost_b / 2 if cost_w is None else cost_w
        idle = (p - 1) * max(0.0, cost_f + (cost_b - w) - w) / (2 if name == "zbv" else 1)
        return idle / (idle + m * (cost_f + cost_b))
    raise ValueError(f"no textbook formula for schedule {name!r}")
