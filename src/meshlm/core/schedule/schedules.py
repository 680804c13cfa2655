"""Pipeline schedules as plain data: one ordered list of `Action`s per rank.

A schedule is data so that the same lists can be checked (check.py), timed
(simulate.py), drawn (draw.py) and executed by the runtime without any of
those parts knowing how the schedule was designed. Each builder decides only
the compute order; `add_p2p` (p2p.py, which documents the SEND/RECV rules the
runtime must follow) inserts the communication.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from ..choices import PP_SCHEDULES, PP_TAKES_VIRTUAL, PP_V_SHAPED
from .actions import Action, stage_index, stage_owner
from .p2p import STEER_COSTS, add_p2p
from .replay import Dataflow, p2p_batches
from .simulate import simulate

__all__ = ["Action", "stage_index", "stage_owner", "add_p2p", "p2p_batches", "gpipe", "one_f_one_b",
           "interleaved", "zb_h1", "zbv", "SCHEDULES", "TAKES_VIRTUAL", "V_SHAPED", "build_schedule"]


# --------------------------------------------------------------------------- schedules


def _validate(p: int, m: int, v: int = 1) -> None:
    for name, val in (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")


def _gpipe_compute(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def _one_f_one_b_compute(p: int, m: int) -> list[list[Action]]:
    out = []
    for r in range(p):
        w = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", w + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - w, m)]
        out.append(acts)
    return out


def _interleaved_compute(p: int, m: int, v: int) -> list[list[Action]]:
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        mb = (k // (p * v)) * p + k % p
        return mb, (chunk if forward else v - 1 - chunk)

    out = []
    for r in range(p):
        w = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [Action("F", *unit(k, True)) for k in range(w)]
        for k in range(total - w):
            acts += [Action("F", *unit(k + w, True)), Action("B", *unit(k, False))]
        acts += [Action("B", *unit(k, False)) for k in range(total - w, total)]
        out.append(acts)
    return out


def _zb_h1_compute(p: int, m: int) -> list[list[Action]]:
    out = []
    for r in range(p):
        w = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(w)]
        pending: deque[int] = deque()  # micro-batches whose W is deferred
        for i in range(m - w):
            acts += [Action("F", w + i), Action("I", i)]
            pending.append(i)
            # Rank r keeps r weight-grads pending: this fills its warm-up gap
            # while in-flight activations stay <= p, 1F1B's peak.
            if len(pending) > r:
                acts.append(Action("W", pending.popleft()))
        for i in range(m - w, m):
            acts.append(Action("I", i))
            pending.append(i)
            if len(pending) > r:
                acts.append(Action("W", pending.popleft()))
        acts += [Action("W", i) for i in pending]
        out.append(acts)
    return out


def _zbv_compute(p: int, m: int, costs: dict, max_deferred: int | None = None) -> tuple[list[list[Action]], int]:
    """ZB-V's compute order, found by list scheduling on simulated time (Qi et al. 2024 build theirs
    the same way: a greedy pass under a memory limit). When an input is there is the replay's rule
    (replay.Dataflow); the choice of what runs next is this function's.

    Rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1). Whenever a rank is free it runs, in
    this order of preference: an input-grad backward I whose gradient has arrived (the critical
    path); a forward F whose input has arrived, if the rank then holds at most 2p chunk activations
    (p micro-batches of all its layers: 1F1B's peak on its first rank); a deferred weight-grad W
    (they fill what would be bubbles). Ties go to the lower micro-batch, then to chunk 1 (deeper in
    the V, nearer its loss). Each chunk runs its F's and its I's in micro-batch order. The loss
    stage's W goes first of all (before any F), so rank 0 holds one micro-batch of logits.

    A deferred W holds more than its chunk's activations: the gradients captured at its boundaries
    for the weight products (parallel/dims/pipeline/backward.py), about as much again. With `max_deferred`
    a rank holding that many such W's (stage 0's hold none: its I is empty) runs the oldest before
    another F. Also returns the peak over ranks of held chunk activations plus such W's.
    """
    z = _ZBVLister(p, m, costs, max_deferred)
    while sum(len(a) for a in z.out) < 6 * m * p:
        order = sorted((q for q in range(p) if len(z.out[q]) < 6 * m), key=lambda q: (z.clock[q], q))
        if not any(z.advance(r, order) for r in order):
            raise AssertionError("zbv list scheduling made no progress")  # a bug, not bad input
    return z.out, z.peak


class _ZBVLister:
    """The state of `_zbv_compute`'s list scheduling: per rank the next micro-batch to forward and to
    backward on each chunk, the deferred W's, held activations and the simulated clock."""

    def __init__(self, p: int, m: int, costs: dict, max_deferred: int | None):
        self.p, self.m, self.max_deferred = p, m, max_deferred
        self.dur = {k: costs[k] for k in ("F", "I", "W")}
        self.flow = Dataflow(p, 2, vshape=True)        # the replay's dependency rule and end times
        self.nxt = {"F": [[0, 0] for _ in range(p)], "I": [[0, 0] for _ in range(p)]}  # next mb per rank, chunk
        self.pending: list[deque] = [deque() for _ in range(p)]  # (mb, chunk) whose W is deferred
        self.held, self.clock = [0] * p, [0.0] * p
        self.deferred, self.peak = [0] * p, 0              # W's holding captured gradients; peak of held + those
        self.out: list[list[Action]] = [[] for _ in range(p)]
        self.step = max(min(self.dur["F"], self.dur["I"]), 1e-6)

    def ready(self, r: int, kind: str, c: int) -> float | None:
        """When the next `kind` on chunk c of rank r has its input (None: not produced yet)."""
        mb = self.nxt[kind][r][c]
        if mb >= self.m or kind == "I" and not self.flow.forward_ran(r, c, mb):
            return None
        return self.flow.input_at(r, kind, c, mb)

    def run(self, r: int, kind: str, mb: int, c: int, start: float) -> None:
        end = start + self.dur[kind]
        self.out[r].append(Action(kind, mb, c))
        self.flow.ran(r, kind, c, mb, end)
        self.clock[r] = end
        if kind in ("F", "I"):
            self.nxt[kind][r][c] += 1
        if kind == "F":
            self.held[r] += 1
        elif kind == "I":
            self.pending[r].append((mb, c))
        else:
            self.held[r] -= 1
        if stage_index(r, c, self.p, True) != 0 and kind in ("I", "W"):
            self.deferred[r] += 1 if kind == "I" else -1
        self.peak = max(self.peak, self.held[r] + self.deferred[r])

    def run_w(self, r: int, which: tuple[int, int], t: float) -> bool:
        self.pending[r].remove(which)
        self.run(r, "W", *which, t)
        return True

    def advance(self, r: int, order: list[int]) -> bool:
        """Rank r runs its preferred action now, or idles until an input may arrive; False: neither."""
        p, t = self.p, self.clock[r]
        cands = []
        for kind, rank_k in (("I", 0), ("F", 1)):
            if kind == "F" and self.held[r] >= 2 * p:
                continue
            for c in (1, 0):
                at = self.ready(r, kind, c)
                if at is not None:
                    cands.append((at > t + 1e-9, rank_k, self.nxt[kind][r][c], -c, at, kind, c))
        loss_w = [x for x in self.pending[r] if stage_index(r, x[1], p, True) == 2 * p - 1]
        if loss_w:   # the loss stage's W before any F: its saved logits are the largest activations
            return self.run_w(r, loss_w[0], t)
        now = [x for x in cands if not x[0]]
        if (self.max_deferred is not None and self.deferred[r] >= self.max_deferred
                and not [x for x in now if x[5] == "I"]):
            return self.run_w(r, next(x for x in self.pending[r] if stage_index(r, x[1], p, True) != 0), t)
        if now:
            _, _, mb, _, _, kind, c = min(now)
            self.run(r, kind, mb, c, t)
            return True
        if self.pending[r]:
            return self.run_w(r, self.pending[r][0], t)
        # idle until a known input arrives or another rank could have produced one
        wake = [x[4] for x in cands] + [self.clock[q] + self.step for q in order if q != r]
        if wake:
            self.clock[r] = min(wake)
            return True
        return False


def gpipe(p: int, m: int, *, costs: dict | None = None) -> list[list[Action]]:
    """GPipe: every rank runs all m forwards, then all m backwards."""
    _validate(p, m)
    return add_p2p(_gpipe_compute(p, m), p, 1, costs=costs)


def one_f_one_b(p: int, m: int, *, costs: dict | None = None) -> list[list[Action]]:
    """1F1B: p-r-1 warm-up forwards, then alternate F/B, then drain the backwards."""
    _validate(p, m)
    return add_p2p(_one_f_one_b_compute(p, m), p, 1, costs=costs)


def interleaved(p: int, m: int, v: int, *, costs: dict | None = None) -> list[list[Action]]:
    """Megatron interleaved 1F1B over v chunks per rank; cuts the bubble by v."""
    _validate(p, m, v)
    if v < 2:
        raise ValueError(f"interleaved needs v >= 2 chunks per rank, got v={v} (use 1f1b for v=1)")
    if m % p:
        raise ValueError(f"interleaved needs microbatches divisible by pp: m={m} is not a multiple of p={p}")
    return add_p2p(_interleaved_compute(p, m, v), p, v, costs=costs)


def zb_h1(p: int, m: int, *, costs: dict | None = None) -> list[list[Action]]:
    """Zero-bubble H1 (Qi et al.): backward split into I and W, W deferred into bubbles."""
    _validate(p, m)
    return add_p2p(_zb_h1_compute(p, m), p, 1, costs=costs)


def zbv(p: int, m: int, v: int = 2, *, costs: dict | None = None, least_memory: bool = True) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024): two chunks per rank in a V, split backward, W's fill the bubbles; peak
    activation memory as 1F1B's first rank. Build with the V stage order (actions.py). Of the orders
    with the least simulated bubble, the one holding the fewest deferred W's (`_zbv_compute`).
    `least_memory=False`: the uncapped order only (the planner, which needs the bubble of many
    layouts: the chosen order's bubble is at most the uncapped one's, equal where tests check it)."""
    _validate(p, m, v)
    if v != 2:
        raise ValueError(f"zbv runs exactly 2 chunks per rank (a V), got v={v}")
    c = {**STEER_COSTS, **(costs or {})}
    best = None
    for cap in (None, 3, 2, 1) if least_memory else (None,):  # the fewest deferred W inputs at the least bubble
        compute, held = _zbv_compute(p, m, c, cap)
        acts = add_p2p(compute, p, 2, costs=c, vshape=True)
        tl = simulate(acts, p, m, 2, cost_f=c["F"], cost_b=c["I"] + c["W"], cost_w=c["W"], vshape=True)
        key = (round(tl.bubble, 9), held)
        if best is None or key < best[0]:
            best = (key, acts)
    return best[1]


SCHEDULES: dict[str, Callable[..., list[list[Action]]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zbv": zbv,
}
TAKES_VIRTUAL = frozenset(PP_TAKES_VIRTUAL)
V_SHAPED = frozenset(PP_V_SHAPED)  # schedules whose chunks sit in a V (actions.py: vshape)
# The config's list of schedule names (meshlm.core.choices) is this registry, nothing more, nothing less.
assert tuple(SCHEDULES) == PP_SCHEDULES, (tuple(SCHEDULES), PP_SCHEDULES)


def build_schedule(name: str, p: int, m: int, v: int = 1, *, costs: dict | None = None,
                   least_memory: bool = True) -> list[list[Action]]:
    """Build schedule `name` for p ranks, m micro-batches, v chunks per rank.

    `costs` (relative F/B/I/W durations) only tunes where p2p is placed. `least_memory=False` skips
    ZB-V's search for the order holding the fewest deferred W's (`zbv`).
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    _validate(p, m, v)
    if name == "zbv":
        return zbv(p, m, v, costs=costs, least_memory=least_memory)
    if name in TAKES_VIRTUAL:
        return SCHEDULES[name](p, m, v, costs=costs)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank; got v={v} (use 'interleaved')")
    return SCHEDULES[name](p, m, costs=costs)
