"""The search's memory of many layouts at once: one (pipeline, sp) group's ZeRO / ep variants × micro-batch
sizes × (AC, offload) choices on every pipeline role, as arrays (plan/search/grouped.py).

It adds the same terms as memory.stage_memory (`state_terms`, the micro-batch's `stage_activation_terms`)
in the same order, so every number is the one `StageMemory.totals` gives (float64 sums in numpy round
as Python's do; a term a layout lacks is added as 0.0, which changes no sum):
    total = ((params + grads) + (adam or 0 + muon)) + acts[ac] + bufs[ac]
    bufs[ac] = working[ac] + loss + the step's buffers + mask + Muon's + each dimension's exchange
tests/test_plan_search_prices.py checks the two agree bit for bit.
"""
from __future__ import annotations

import numpy as np

from ...core.choices import AC_MODES
from .memory import stage_activation_terms, state_terms
from .options import Options
from ..spec import Shape, Spec

_NONE = AC_MODES.index("none")


def _padded(rows: list[list[float]]) -> np.ndarray:
    """Ragged rows of terms as a matrix, the missing ones 0.0 (adding 0.0 changes no sum)."""
    width = max((len(r) for r in rows), default=0)
    return np.array([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=np.float64).reshape(len(rows), width)


def _act_side(shape: Shape, s: Spec, stage: str, eps_on: list[bool], mbs: list[int], accums: list[int],
              o: Options) -> tuple:
    """Per (ep on/off, micro-batch): the activations and working set per AC mode, and the loss, mask and
    dimension buffers, as arrays [E, M, ...] (`stage_activation_terms` of every size)."""
    rows: list = [([], [], [], [], []) for _ in eps_on]  # acts, work, loss, mask, dims per ep on/off
    for mb, m in zip(mbs, accums):  # with ep on, the terms add only the all-to-all's buffer: priced once
        _, block, act, lo, ma, di = stage_activation_terms(
            shape, stage, s.tp, eps_on[-1], s.pp, s.pp_virtual, s.pp_schedule, s.pp_layers, s.sp_enabled, s.cp,
            s.cp_impl, mb, m, s.seq_len, s.precision, o)
        work = [block[_NONE] * (1.0 if ac == "full" else 0.5) for ac in AC_MODES]
        loss, mask = [v for _, v in lo], [v for _, v in ma]
        for on, (acts_, work_, loss_, mask_, dims_) in zip(eps_on, rows):
            acts_.append(act)
            work_.append(work)
            loss_.append(loss)
            mask_.append(mask)
            dims_.append([v for k, v in di if on or k != "ep_all_to_all"])
    acts, work, loss, mask, dims = ([r for e in rows for r in e[k]] for k in range(5))
    E, M = len(eps_on), len(mbs)

    def grid(rows):
        x = _padded(rows)
        return x.reshape(E, M, x.shape[1])
    return grid(acts), grid(work), grid(loss), grid(mask), grid(dims)


def _role_totals(shape: Shape, floors: list[Spec], stage: str, mbs: list[int], accums: list[int], o: Options,
                 choices: list[tuple[str, str]]) -> np.ndarray:
    """Bytes [V, M, C] on `stage`'s rank of each variant (its Spec at any micro-batch: `floors`), size and choice."""
    eps_on = sorted({f.ep_enabled for f in floors})
    ev = np.array([eps_on.index(f.ep_enabled) for f in floors])
    states = [state_terms(shape, f, stage) for f in floors]
    muon = floors[0].optim == "muon"
    acts, work, loss, mask, dims = (x[ev] for x in _act_side(shape, floors[0], stage, eps_on, mbs, accums, o))
    step = _padded([[v for _, v in st[4]] for st in states])
    bufs = work  # [V, M, A]: sum((working, *rest)) from the left, as stage_memory
    for k in range(loss.shape[2]):
        bufs = bufs + loss[:, :, k:k + 1]
    for k in range(step.shape[1]):
        bufs = bufs + step[:, k, None, None]
    for k in range(mask.shape[2]):
        bufs = bufs + mask[:, :, k:k + 1]
    if muon:
        bufs = bufs + np.array([st[6] for st in states])[:, None, None]
    for k in range(dims.shape[2]):
        bufs = bufs + dims[:, :, k:k + 1]
    pg = np.array([st[1] + st[2] for st in states])
    adam, mu = np.array([st[3] for st in states]), np.array([st[5] for st in states])
    a_idx = [AC_MODES.index(ac) for ac, _ in choices]
    pre = np.stack([pg + ((adam if off == "none" else 0.0) + mu) for _, off in choices], axis=1)  # [V, C]
    return (pre[:, None, :] + acts[:, :, a_idx]) + bufs[:, :, a_idx]


def worst_grid(shape: Shape, floors: list[Spec], stages: tuple[str, ...], mbs: list[int], accums: list[int],
               o: Options, choices: list[tuple[str, str]], valid: np.ndarray, usable: float) -> tuple:
    """(worst [V, M, C]: each choice's bytes on the fullest role, need [V, M]: the least bytes over a
    variant's `valid` choices on the roles the search priced before it knew nothing fits (it stops at
    the first role that rules every choice out, as the serial search's message reads))."""
    worst = need = done = None
    for st in stages:
        tot = _role_totals(shape, floors, st, mbs, accums, o, choices)
        worst = tot if worst is None else np.maximum(worst, tot)
        least = np.where(valid[:, None, :], worst, np.inf).min(axis=2)
        if need is None:
            need, done = np.full(least.shape, np.nan), np.zeros(least.shape, dtype=bool)
        newly = (least > usable) & ~done
        need[newly] = least[newly]
        done |= newly
    return worst, need
