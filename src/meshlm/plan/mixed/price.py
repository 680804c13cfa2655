"""Pricing one layout on a mixed cluster (plan/cluster.py): each pipeline stage or data-parallel replica
on its own card, and the two choices that give each card work in proportion to its speed and memory:
`pp_layers` (`speed_split`) and `dp_weights` (`dp_split`). docs/heterogeneous.md, "Planning a mixed
cluster".

A group of ranks that runs in lock step (a stage's TP × CP × DP ranks; a replica's TP ranks) runs at
its slowest card's pace, so each stage or replica is priced on one profile (`Cluster.slowest`), by the
same stage model `meshlm estimate` uses (estimate.stage_time, memory.stage_memory).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import heapq
from functools import lru_cache
from math import gcd

from ..cluster import Cluster, Group
from ..cost.estimate import (SIM_MAX_UNITS, built_schedule, stage_time, bubble_formula, micro_times, step_terms, time_model)
from ..cost.memory import stage_memory
from ..cost.options import Options
from ..spec import Shape, Spec

PIPE_SCHEDULES = ("1f1b", "zb-h1")  # one chunk per rank: a stage is a rank, so its card is known; gpipe
# holds every micro-batch at the same speed as 1f1b (dominated)


@dataclass
class Priced:
    """One layout on a mixed cluster: the step, and per group of the cluster what its ranks hold and do."""
    spec: Spec
    spans: str             # the dimension that crosses device types: "pp" or "dp"
    step_s: float
    per_type: list[dict]   # per Group: card, gpus, bytes (its fullest rank), usable, busy_s, work
    fits: bool
    source: str = "formula"  # how the pipeline's makespan was found: formula or simulator


def unit_groups(cluster: Cluster, unit: int) -> list[Group]:
    """The card each block of `unit` consecutive ranks runs at (its slowest)."""
    return [cluster.slowest(cluster.types_in(first, unit)) for first in range(0, cluster.world, unit)]


# ---------------------------------------------------------------------------------- pipeline across types

def block_costs(shape: Shape, s: Spec, gpu, o: Options) -> tuple[float, float]:
    """(one block's, the head's) forward + backward + recompute seconds per micro-batch on `gpu`."""
    ac = "none" if s.ac == "selective" and s.cp_enabled else s.ac  # as estimate.stage_time runs it
    return _block_costs_of(shape, s.tp, s.sp, s.ep, s.cp, s.seq_len, s.micro_batch, ac, s.precision, gpu, o)


@lru_cache(maxsize=4096)
def _block_costs_of(shape: Shape, tp: int, sp: bool, ep: int, cp: int, seq: int, mb: int, ac: str, precision: str,
                    gpu, o: Options) -> tuple[float, float]:
    def total(head: bool) -> float:
        mt = micro_times(shape, tp, sp, ep, cp, seq, 1, head, mb, ac, precision, gpu, o)
        return mt["t_f"] + mt["t_b"] + mt["t_rc"]
    block = total(False)
    return block, max(0.0, total(True) - block)


@lru_cache(maxsize=65536)
def greedy_counts(n: int, cost: tuple, extra: tuple, caps: tuple) -> tuple[int, ...] | None:
    """Blocks per stage minimising the slowest stage (k·cost + extra), at most `caps` each: one block
    each, then every next block where it finishes earliest (optimal for a max of increasing terms)."""
    p = len(cost)
    if n < p or sum(caps) < n or min(caps) < 1:
        return None
    k = [1] * p
    heap = [(2 * cost[r] + extra[r], r) for r in range(p) if caps[r] > 1]
    heapq.heapify(heap)
    for _ in range(n - p):
        _, r = heapq.heappop(heap)
        k[r] += 1
        if k[r] < caps[r]:
            heapq.heappush(heap, ((k[r] + 1) * cost[r] + extra[r], r))
    return tuple(k)


def _with(n: int, p: int, r: int, k: int) -> tuple[int, ...]:
    """A split of n blocks over p stages with k on stage r (the rest spread): a stage's memory depends
    on its own blocks only, so this prices stage r at k blocks."""
    rest, others = n - k, p - 1
    fill = [rest // others + (1 if i < rest % others else 0) for i in range(others)]
    return tuple(fill[:r] + [k] + fill[r:])


def rank_bytes(shape: Shape, s: Spec, r: int, o: Options) -> float:
    """Pipeline rank r's bytes under s's own AC mode and offload (one StageMemory serves them all)."""
    return _memory(shape, dataclasses.replace(s, ac="none", offload="none"), r, o).total(s.ac, s.offload)


@lru_cache(maxsize=65536)
def _memory(shape: Shape, plain: Spec, r: int, o: Options):
    """Rank r's StageMemory of `plain` (a Spec with ac and offload "none": it prices every choice)."""
    return stage_memory(shape, plain, f"rank{r}", o)


@lru_cache(maxsize=65536)
def _line(shape: Shape, plain: Spec, r: int, o: Options) -> tuple:
    """Rank r's StageMemory at 1 and at 2 blocks: a rank's bytes are affine in its blocks (states and
    saved activations per block; the rest fixed), so two sizes give the line."""
    n, p = shape.args.n_layers, plain.pp
    return tuple(_memory(shape, dataclasses.replace(plain, pp_layers=_with(n, p, r, k)), r, o) for k in (1, 2))


def block_cap(shape: Shape, plain: Spec, r: int, card: Group, o: Options, ac: str, offload: str) -> int:
    """The most blocks pipeline rank r's card holds under this AC mode and offload (`_line`)."""
    n, p = shape.args.n_layers, plain.pp
    one, two = (m.total(ac, offload) for m in _line(shape, plain, r, o))
    room, per = o.usable(card.gpu) - one, two - one
    return 0 if room < 0 else n - p + 1 if per <= 0 else min(n - p + 1, 1 + int(room // per))


def speed_split(shape: Shape, s: Spec, cards: list[Group], o: Options) -> tuple[int, ...] | None:
    """`pp_layers` for stages on `cards` (one per pipeline rank): balanced by each card's block time
    (the last stage also runs the head), no stage holding more blocks than its card's memory takes
    (`block_cap`, asked of the stages the balanced split overfills); None when no split fits."""
    same = "1f1b" if s.pp_schedule == "zb-h1" else s.pp_schedule  # the same micro-batches in flight (stages.inflight)
    return _split(shape, dataclasses.replace(s, pp_schedule=same), tuple(cards), o)


@lru_cache(maxsize=4096)
def _split(shape: Shape, s: Spec, cards: tuple, o: Options) -> tuple[int, ...] | None:
    n, p = shape.args.n_layers, s.pp
    if n - p + 1 < 2:
        return tuple([1] * p) if n == p else None
    cost, head = zip(*(block_costs(shape, s, g.gpu, o) for g in cards))
    extra, caps = tuple([0.0] * (p - 1) + [head[-1]]), [n] * p
    plain = dataclasses.replace(s, ac="none", offload="none")
    while True:
        counts = greedy_counts(n, tuple(cost), extra, tuple(caps))
        if counts is None:
            return None
        at = dataclasses.replace(plain, pp_layers=counts)
        over = [r for r in range(p) if caps[r] == n
                and _memory(shape, at, r, o).total(s.ac, s.offload) > o.usable(cards[r].gpu)]
        if not over:
            return counts
        for r in over:
            caps[r] = block_cap(shape, plain, r, cards[r], o, s.ac, s.offload)


def _makespan(s: Spec, rank_fbw: list[tuple[float, float, float]], simulate: bool) -> tuple[float, str]:
    """The pipeline's compute makespan for per-rank (F, B, W) per micro-batch: the simulator with each
    rank's own costs, or (too many actions, or not asked) the slowest rank's with the bubble formula."""
    m, p = s.accum, s.pp
    if simulate and p * m <= SIM_MAX_UNITS:
        from ...core.schedule import simulate as run
        f, b, w = rank_fbw[0]
        tl = run(built_schedule(s.pp_schedule, p, m, 1), p, m, 1, cost_f=f, cost_b=b, cost_w=w, rank_costs=rank_fbw)
        return tl.makespan, "simulator"
    f, b, w = max(rank_fbw, key=lambda x: x[0] + x[1])
    return m * (f + b) * (1 + bubble_formula(s.pp_schedule, p, m, 1, f, b, w)), "formula"


def price_pipeline(shape: Shape, s: Spec, cluster: Cluster, o: Options, simulate: bool = False) -> Priced:
    """Pipeline stages on their own cards (s.pp_layers as given): each rank's stage time, the makespan
    of the schedule with those times, then the slowest rank's step tail (exposed step communication,
    optimizer, offload)."""
    cards = unit_groups(cluster, cluster.world // s.pp)
    m = s.accum
    fbw, tails, mem, busy, blocks = [], [], [], [], []
    for r, g in enumerate(cards):
        t = stage_time(shape, s, f"rank{r}", g.gpu, o)
        x = (t["exposed_mb"] + t["overlap_mb"]) / m
        f, b = t["t_f"] + x / 2, t["t_b"] + t["t_rc"] + x / 2
        fbw.append((f, b, min(t["t_b"] / 2, b)))
        opt, off, _, overhead = step_terms(s, t["params"], g.gpu, o)
        tails.append(t["exposed_step"] + t["overlap_step"] + opt + off + t["muon_s"] + overhead)
        mem.append(rank_bytes(shape, s, r, o))
        busy.append(m * (f + b))
        blocks.append(t["params"].layers)  # s.pp_layers, or the runtime's own split when it is empty
    span, source = _makespan(s, fbw, simulate)
    step = span + max(tails)
    return Priced(s, "pp", step, _per_type(cluster, cards, mem, busy, o, "layers", blocks),
                  all(x <= o.usable(g.gpu) for x, g in zip(mem, cards)), source)


def _per_type(cluster: Cluster, units: list[Group], mem: list[float], busy: list[float], o: Options,
              what: str, work: list) -> list[dict]:
    """Per group of the cluster: its fullest unit's bytes, its busiest unit's compute, its units' work."""
    out = []
    for g in cluster.groups:
        mine = [i for i, u in enumerate(units) if u is g]
        if not mine:
            continue
        out.append({"card": g.card, "gpu": g.gpu.name, "gpus": g.count, "bytes": max(mem[i] for i in mine),
                    "usable": o.usable(g.gpu), "busy_s": max(busy[i] for i in mine),
                    "units": len(mine), what: [work[i] for i in mine]})
    return out


# ---------------------------------------------------------------------------------- data parallel across types

def dp_split(total: int, replicas: list[int], times: list[float]) -> tuple[int, ...] | None:
    """Micro-batches per replica of each type (`replicas[i]` replicas, `times[i]` seconds per
    micro-batch) adding up to `total`, at least one each, the slowest type's busy time least: the
    continuous answer (proportional to speed), rounded around it; None when none exists."""
    k = len(replicas)
    if sum(replicas) > total:
        return None
    ideal = [total / t / sum(n / x for n, x in zip(replicas, times)) for t in times]
    best, best_cost = None, float("inf")

    def walk(i: int, left: int, chosen: list[int]) -> None:
        nonlocal best, best_cost
        if i == k - 1:
            if left % replicas[i] == 0 and left // replicas[i] >= 1:
                a = chosen + [left // replicas[i]]
                cost = max(x * t for x, t in zip(a, times))
                if cost < best_cost:
                    best, best_cost = tuple(a), cost
            return
        centre = int(ideal[i])
        for a in range(max(1, centre - 3), centre + 4):
            if a * replicas[i] < left:
                walk(i + 1, left - a * replicas[i], chosen + [a])
    walk(0, total, [])
    return best


def weights_of(accums: list[int]) -> list[int]:
    """parallel.dp_weights of per-replica micro-batch counts: the counts over their common divisor."""
    g = 0
    for a in accums:
        g = gcd(g, a)
    return [a // g for a in accums]


def price_data(shape: Shape, s: Spec, cluster: Cluster, o: Options) -> Priced:
    """Data-parallel replicas on their own cards (pp = 1), replica r running s.dp_accums[r] micro-batches
    (all `accum` without weights): each type's step with its own count, priced as `meshlm estimate`
    prices one replica; the step is the slowest type's (the gradient all-reduce waits for it, and runs
    at the slower card's links)."""
    cards = unit_groups(cluster, cluster.world // s.dp)
    accums = list(s.dp_accums) or [s.accum] * s.dp
    mem, busy, steps = [], [], {}
    for g, a in zip(cards, accums):
        key = (id(g), a)
        if key not in steps:
            one = dataclasses.replace(s, accum=a, dp_accums=())
            t = time_model(shape, one, g.gpu, o, simulate=False)
            steps[key] = (t["step_s"], stage_memory(shape, one, "only", o).total(),
                          t["time"]["forward_s"] + t["time"]["backward_s"] + t["time"]["recompute_s"])
        step, b, work = steps[key]
        mem.append(b)
        busy.append(work)
    step = max(x[0] for x in steps.values())
    rows = [a * s.micro_batch for a in accums]
    return Priced(s, "dp", step, _per_type(cluster, cards, mem, busy, o, "sequences", rows),
                  all(x <= o.usable(g.gpu) for x, g in zip(mem, cards)))
