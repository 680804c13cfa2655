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

from ...choices import PP_SCHEDULES, PP_TAKES_VIRTUAL
from .actions import Action, stage_index, stage_owner
from .p2p import add_p2p, p2p_batches

__all__ = ["Action", "stage_index", "stage_owner", "add_p2p", "p2p_batches", "gpipe", "one_f_one_b",
           "interleaved", "zb_h1", "SCHEDULES", "TAKES_VIRTUAL", "build_schedule"]


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


SCHEDULES: dict[str, Callable[..., list[list[Action]]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}
TAKES_VIRTUAL = frozenset(PP_TAKES_VIRTUAL)
# The config's list of schedule names (meshlm.choices) is this registry, nothing more, nothing less.
assert tuple(SCHEDULES) == PP_SCHEDULES, (tuple(SCHEDULES), PP_SCHEDULES)


def build_schedule(name: str, p: int, m: int, v: int = 1, *, costs: dict | None = None) -> list[list[Action]]:
    """Build schedule `name` for p ranks, m micro-batches, v chunks per rank.

    `costs` (relative F/B/I/W durations) only tunes where p2p is placed.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    _validate(p, m, v)
    if name in TAKES_VIRTUAL:
        return SCHEDULES[name](p, m, v, costs=costs)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank; got v={v} (use 'interleaved')")
    return SCHEDULES[name](p, m, costs=costs)
