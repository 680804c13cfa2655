"""Time a schedule with a cost model, to compare schedules before touching GPUs.

Each rank runs its list in order; a compute starts when the rank is free and
its inputs exist (forward of stage s-1, backward of stage s+1, own forward /
I). A cross-rank input arrives `cost_comm` after it was produced. The `p2p`
mode says how far p2p batches also block, to price the runtime's choices.

Costs are per micro-batch for a rank's whole share of the model, so with v
chunks each chunk's F costs cost_f / v. A split backward costs
I = cost_b - cost_w and W = cost_w (default cost_w = cost_b / 2).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, ScheduleError, source_of, stage_index
from .check import inflight_profile, match_p2p
from .p2p import p2p_batches


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
             p2p: str = "free", name: str = "", vshape: bool = False) -> Timeline:
    """Simulate `actions` (as built by schedules.py) and return its Timeline.

    p2p="free": p2p only carries data (arrives cost_comm after production),
    the textbook assumption. "blocking": every batch is waited on whole
    before the next compute and a send needs its recv posted (the rendezvous
    model check.py proves safe), which is what a runtime pays if it waits
    on every batch_isend_irecv.
    """
    dur = action_costs(v, cost_f, cost_b, cost_w)
    if cost_comm < 0:
        raise ValueError(f"cost_comm must be >= 0, got {cost_comm}")
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p must be one of {P2P_MODES}, got {p2p!r}")
    pairs = match_p2p(actions, p, vshape) if p2p != "free" else {}
    items, groups, grp_of = [], [], []
    for acts in actions:
        row, grps, of, i = [], [], {}, 0
        for it in p2p_batches(acts):
            row.append((i, it, len(grps) if isinstance(it, tuple) else None))
            if isinstance(it, tuple):
                for j in range(len(it)):
                    of[i + j] = len(grps)
                grps.append((i, it))
                i += len(it)
            else:
                i += 1
        items.append(row)
        groups.append(grps)
        grp_of.append(of)
    post = [[None] * len(g) for g in groups]
    active = [[None] * len(g) for g in groups]
    done = [[None] * len(g) for g in groups]
    resolved = [0] * p
    clock = [0.0] * p
    pos = [0] * p
    fwd_end: dict[tuple[int, int], float] = {}    # (stage, mb) -> end time
    bwd_end: dict[tuple[int, int], float] = {}    # B or I
    rows: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]

    def activate(r: int, g: int):
        # a batch starts on the wire once posted and once the rank's previous batch is done
        if active[r][g] is None and post[r][g] is not None and (g == 0 or done[r][g - 1] is not None):
            active[r][g] = max(post[r][g], done[r][g - 1] if g else 0.0)
        return active[r][g]

    def try_resolve(r: int) -> bool:
        g = resolved[r]
        if g >= len(groups[r]) or activate(r, g) is None:
            return False
        start_i, ops = groups[r][g]
        end = active[r][g]
        for j in range(len(ops)):
            q, qi = pairs[(r, start_i + j)]
            other = activate(q, grp_of[q][qi])
            if other is None:
                return False
            end = max(end, other + cost_comm)
        done[r][g] = end
        resolved[r] += 1
        return True

    def try_step(r: int) -> bool:
        _, it, g = items[r][pos[r]]
        if g is not None:
            if p2p == "free":
                return True
            if post[r][g] is None:
                post[r][g] = clock[r]
            while try_resolve(r):
                pass
            if done[r][g] is None:
                return False
            clock[r] = max(clock[r], done[r][g])
            return True
        ready = clock[r]
        src = source_of(it, r, p, v, vshape)
        if src is not None:
            ends = fwd_end if it.kind == "F" else bwd_end
            t = ends.get((stage_index(src[0], src[1], p, vshape), it.mb))
            if t is None:
                return False
            ready = max(ready, t + (cost_comm if src[0] != r else 0.0))
        end = ready + dur[it.kind]
        rows[r].append((ready, end, it))
        clock[r] = end
        s = stage_index(r, it.chunk, p, vshape)
        if it.kind == "F":
            fwd_end[(s, it.mb)] = end
        elif it.kind in ("B", "I"):
            bwd_end[(s, it.mb)] = end
        return True

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(items[r]) and try_step(r):
                pos[r] += 1
                progress = True
            while p2p != "free" and try_resolve(r):
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(items[r])]
    if stuck:
        what = ", ".join(f"rank {r} at {items[r][pos[r]][1]}" for r in stuck)
        raise ScheduleError(f"simulation stuck (run check_schedule for details): {what}")
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
