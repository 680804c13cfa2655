"""One (pipeline, sp) group of the search (plan/search/ranked.py `_layouts`): its ZeRO × ep variants, each at
every micro-batch size, priced at once (plan/cost/memory_grid.py) and then ranked in the serial order.

What a variant goes through is the search's rule, unchanged: memory only grows with the micro-batch,
so its first size where no (AC, offload) choice fits ends it (the sizes after count as out of memory);
at each smaller size the fastest AC that fits without offload is timed, and with offload only an AC
cheaper than that one; the others are dominated. Counts, reasons and their first examples come out as
the serial loop made them, and the layouts are timed in its order with its tie numbers, so the heap of
the fastest is the same. A layout is timed only when its lower bound (search.group_lower_bound: compute,
TP and EP time, which the full model never undercuts) is below the slowest of a full heap: one at or
above it cannot enter the heap, as no layout slower than the `keep` fastest so far can.
"""
from __future__ import annotations

import heapq

import numpy as np

from ...core.choices import AC_MODES, HELD
from ..cost.comm import ep_collectives, link
from ..cost.estimate import bubble_formula, micro_seconds, time_model
from ..hardware import GIB
from ..cost.memory import state_floor
from ..cost.memory_grid import worst_grid
from ..cost.options import Options
from ..spec import Spec
from ..cost.stages import pipeline_roles, stage_params

_OOM_ALL = "out of memory even with the most memory-saving AC / offload"
_OOM_SOME = "out of memory with this AC / offload (a more memory-saving one fits)"
_INTERLEAVED = "interleaved needs microbatches divisible by pp"


def search_group(ctx, bases: list, o: Options, offs: list[str], b_local: int, mbs: list[int]) -> None:
    """Every variant of one group (`bases`: a layout's keys but the micro-batch, in the loop's order;
    None where ep does not divide dp_shard×cp) at the micro-batch sizes `mbs` of `b_local` sequences."""
    full = [(ac, off) for off in offs for ac in ctx.acs]
    events: list = []  # (position, reason, count, example): applied in the loop's order at the end
    live = []
    for j, base in enumerate(bases):
        if base is None:
            events.append(((j, -1), "ep does not divide dp_shard×cp", 1, None))
            continue
        choices = [(ac, off) for off in offs if off == "none" or base["zero"] for ac in ctx.acs]
        if not choices:  # offload fixed, but nothing to offload: zero = 0
            events.append(((j, -1), "offload needs a ZeRO stage that shards the optimizer (zero >= 1)", len(mbs), None))
            continue
        floor = Spec(**base, micro_batch=1, accum=b_local)
        if mbs and floor.optim != "muon" and max(state_floor(ctx.shape, floor, st, choices)
                                                 for st in pipeline_roles(floor.pp)) > ctx.usable:
            events.append(((j, -1), _OOM_ALL, len(mbs) * len(choices),
                           f"tp{floor.tp} cp{floor.cp} pp{floor.pp} dp{floor.dp} zero{floor.zero} g{floor.zero_group} "
                           f"{floor.pp_schedule}: its weights, gradients and optimizer state alone exceed usable "
                           f"{ctx.usable / GIB:.1f} GiB"))
            continue
        live.append((j, base, floor))
    if live and mbs:
        _sizes(ctx, live, mbs, [b_local // mb for mb in mbs], o, full, events)
    _apply(ctx, events)


def _apply(ctx, events: list) -> None:
    """The group's rejections, a reason's count summed, in the order each reason first occurred (the
    tallies' insertion order and first examples are the serial loop's)."""
    first: dict = {}
    for pos, reason, n, example in sorted(events, key=lambda e: e[0]):
        if reason in first:
            first[reason][1] += n
        else:
            first[reason] = [pos, n, example]
    for reason, (_, n, example) in first.items():
        ctx.reject(reason, n, example)


def _sizes(ctx, live: list, mbs: list[int], accums: list[int], o: Options, full: list, events: list) -> None:
    """The micro-batch sizes of the live variants: their memory at once, the counts, then the ranking."""
    floors = [f for _, _, f in live]
    valid = np.array([[off == "none" or f.zero for _, off in full] for f in floors], dtype=bool)  # [V, C]
    sched, pp = floors[0].pp_schedule, floors[0].pp
    ok = np.array([not (sched == "interleaved" and m % pp) for m in accums], dtype=bool)    # [M]
    worst, need = _priced(ctx, floors, mbs, accums, o, full, valid, ok)
    M = worst.shape[1]  # the sizes priced: all, or up to where every variant has met one that nothing fits
    ok = ok[:M]
    fits = valid[:, None, :] & (worst <= ctx.usable)                                          # [V, M, C]
    nfit, nvalid = fits.sum(axis=2), valid.sum(axis=1)
    out = ok[None, :] & (nfit == 0)
    cut = np.where(out.any(axis=1), out.argmax(axis=1), M)                                   # [V]
    before = np.arange(M)[None, :] < cut[:, None]
    run = before & ok[None, :]
    _size_events(ctx, live, mbs, before & ~ok[None, :], run & (nfit < nvalid[:, None]),
                 (nvalid[:, None] - nfit) * run, cut, need, nvalid, events)
    picks = np.where(run[:, :, None], _fastest(fits, full), 0)                               # [V, M, 2]
    n_fit = int((nfit * run).sum())
    ctx.counts["candidates"] += n_fit
    ctx.counts["fit"] += n_fit
    ctx.counts["dominated"] += n_fit - int((picks > 0).sum())
    _rank_all(ctx, live, mbs, accums, o, full, worst, picks)


def _priced(ctx, floors: list, mbs: list[int], accums: list[int], o: Options, full: list, valid: np.ndarray,
            ok: np.ndarray) -> tuple:
    """worst_grid of the first sizes, in chunks of growing length, until each variant has met a size at
    which nothing fits (the larger ones are never priced, as in the serial loop) or the sizes run out."""
    stages, parts, a, step = pipeline_roles(floors[0].pp), [], 0, 4
    ended = np.zeros(len(floors), dtype=bool)
    while a < len(mbs) and not ended.all():
        b = min(len(mbs), a + step)
        worst, need = worst_grid(ctx.shape, floors, stages, mbs[a:b], accums[a:b], o, full, valid, ctx.usable)
        parts.append((worst, need))
        nfit = (valid[:, None, :] & (worst <= ctx.usable)).sum(axis=2)
        ended |= (ok[None, a:b] & (nfit == 0)).any(axis=1)
        a, step = b, 2 * step
    return np.concatenate([w for w, _ in parts], axis=1), np.concatenate([n for _, n in parts], axis=1)


def _size_events(ctx, live: list, mbs: list[int], inter: np.ndarray, some: np.ndarray, n_some: np.ndarray,
                 cut: np.ndarray, need: np.ndarray, nvalid: np.ndarray, events: list) -> None:
    """The rejections of each variant's sizes: interleaved's indivisible accumulations, the choices out of
    memory where another fits, and from the first size where none fits, every size after it."""
    for v, (j, _, f) in enumerate(live):
        if inter[v].any():
            events.append(((j, int(inter[v].argmax())), _INTERLEAVED, int(inter[v].sum()), None))
        if some[v].any():
            events.append(((j, int(some[v].argmax())), _OOM_SOME, int(n_some[v].sum()), None))
        i = int(cut[v])
        if i < len(mbs):
            events.append(((j, i), _OOM_ALL, (len(mbs) - i) * int(nvalid[v]),
                           f"tp{f.tp} cp{f.cp} pp{f.pp} dp{f.dp} zero{f.zero} g{f.zero_group} {f.pp_schedule} "
                           f"mb{mbs[i]}: needs {float(need[v, i]) / GIB:.1f} GiB > usable {ctx.usable / GIB:.1f} GiB"))


def _fastest(fits: np.ndarray, full: list) -> np.ndarray:
    """[V, M, 2] picks of which choice to time: slot 0 the fastest AC that fits without offload, slot 1
    with offload only an AC cheaper than that one (AC modes go fastest first, offload only adds time).
    Holds the choice's index + 1 (0: none)."""
    order = np.array([AC_MODES.index(ac) for ac, _ in full])
    plain = np.array([off == "none" for _, off in full], dtype=bool)
    fp = fits & plain
    has0 = fp.any(axis=2)
    c0 = fp.argmax(axis=2)
    limit = np.where(has0, order[c0], len(AC_MODES))
    fo = fits & ~plain & (order[None, None, :] < limit[:, :, None])
    has1 = fo.any(axis=2)
    return np.stack([np.where(has0, c0 + 1, 0), np.where(has1, fo.argmax(axis=2) + 1, 0)], axis=2)


def _rank_all(ctx, live: list, mbs: list[int], accums: list[int], o: Options, full: list, worst: np.ndarray,
              picks: np.ndarray) -> None:
    """Time the picked layouts in the loop's order (variant, size, slot), each unless its lower bound
    cannot reach a full heap, and keep the fastest; tie numbers count every pick, timed or not."""
    v_i, m_i, s_i = np.nonzero(picks)
    n = len(v_i)
    if not n:
        return
    c_i = picks[v_i, m_i, s_i] - 1
    lb = _bounds(ctx, live, mbs, accums, o, full, v_i, m_i, c_i)
    heap, tie0, k = ctx.heap, ctx.tie, 0
    while k < n:
        if len(heap) >= ctx.keep:
            later = np.flatnonzero(lb[k:] < -heap[0][0])
            if not later.size:
                ctx.counts["bounded"] += n - k
                break
            ctx.counts["bounded"] += int(later[0])
            k += int(later[0])
        v, i, c = int(v_i[k]), int(m_i[k]), int(c_i[k])
        ac, off = full[c]
        spec = Spec(**live[v][1], micro_batch=mbs[i], accum=accums[i], ac=ac, offload=off)
        step = time_model(ctx.shape, spec, ctx.gpu, o, simulate=False)["step_s"]
        ctx.counts["timed"] += 1
        item = (-step, tie0 + k + 1, spec, float(worst[v, i, c]))
        if len(heap) < ctx.keep:
            heapq.heappush(heap, item)
        elif step < -heap[0][0]:
            heapq.heapreplace(heap, item)
        k += 1
    ctx.tie = tie0 + n


def _bounds(ctx, live: list, mbs: list[int], accums: list[int], o: Options, full: list, v_i, m_i, c_i) -> np.ndarray:
    """Each pick's lower bound: it depends on the expert degree, the size and the AC mode, not on ZeRO,
    so each of those is bounded once (on one Spec per degree and size: building one costs more than
    the bound's cached parts)."""
    got: dict = {}
    specs: dict = {}
    out = np.empty(len(v_i))
    for k, (v, i, c) in enumerate(zip(v_i.tolist(), m_i.tolist(), c_i.tolist())):
        base, ac = live[v][1], full[c][0]
        key = (base["ep"], i, ac)
        lb = got.get(key)
        if lb is None:
            spec = specs.get(key[:2])
            if spec is None:
                spec = specs[key[:2]] = Spec(**base, micro_batch=mbs[i], accum=accums[i])
            lb = got[key] = group_lower_bound(ctx, o, spec, ac)
        out[k] = lb
    return out


def group_lower_bound(ctx, o: Options, s: Spec, ac: str) -> float:
    """Compute time plus the bandwidth term of the (never hidden) TP reductions of `s` under AC mode
    `ac`; no other communication, optimizer or offload: never above the full time model's step time."""
    shape, gpu = ctx.shape, ctx.gpu
    tokens = s.micro_batch * s.seq_len / s.cp
    tp_s = 0.0
    if s.tp_enabled:
        e = HELD[s.precision].act
        tp_s = 2 * (s.tp - 1) / s.tp * e * shape.args.dim * tokens / (link(gpu, s.tp, 1)[1] * o.comm_efficiency)
    m, full, busy = s.accum, [], []
    for st in pipeline_roles(s.pp):  # the real worst stage is unknown here: bound with the least of the per-stage bounds
        sp = stage_params(shape, s, st)
        run_ac = "none" if ac == "selective" and s.cp_enabled else ac
        key = (s.tp, s.sp, s.ep, s.cp, sp.layers, sp.head, s.micro_batch, run_ac, o)
        mt = ctx.micro.get(key)
        if mt is None:  # the search's shape, GPU, sequence and precision are fixed: the rest is the key
            mt = ctx.micro[key] = micro_seconds(shape, s.tp, s.sp, s.ep, s.cp, s.seq_len, sp.layers, sp.head,
                                                s.micro_batch, run_ac, s.precision, gpu, o)
        t_f, t_b, t_rc = mt
        x = sp.layers * 2 * (3 if ac == "full" else 2) * tp_s + _ep_seconds(ctx, o, s, sp.layers, ac)
        f, b = t_f + x / 2, t_b + t_rc + x / 2
        busy.append(m * (f + b))
        full.append(m * (f + b) * (1 + bubble_formula(s.pp_schedule, s.pp, m, s.pp_virtual, f, b, t_b / 2)))
    return max(min(full), max(busy))


def _ep_seconds(ctx, o: Options, s: Spec, layers: int, ac: str) -> float:
    """One micro-batch's expert-parallel all-to-alls on a stage of `layers` blocks: never hidden
    (plan/cost/estimate.py), so they belong in the bound; for a MoE model they are often the largest term."""
    if not s.ep_enabled:
        return 0.0
    key = ("ep", s.ep, s.tp, s.cp, s.micro_batch, layers, ac, s.precision, s.fp8_comm)
    got = ctx.micro.get(key)
    if got is None:
        step = ep_collectives(ctx.shape, s, layers, ac, ctx.gpu, o.comm_efficiency)  # linear in the accumulation
        got = ctx.micro[key] = sum(c.seconds for c in step) / s.accum
    return got
