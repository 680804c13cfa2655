"""`meshlm plan` over a mixed cluster: which dimension crosses device types, the weights, and whether
the slower cards pay (docs/heterogeneous.md, "Planning a mixed cluster").

Two families of layouts put each type to work at its own pace:
- pipeline across types: every stage is one block of ranks of one type (stage size divides each
  group), TP / CP / DP / ZeRO inside the stage; `pp_layers` gives the stages on slower or smaller
  cards fewer blocks (hetero_price.speed_split); the schedule runs one chunk per rank.
- data parallel across types: pp = cp = ep = 1 (what parallel.dp_weights runs today), TP inside a
  replica of one type, DDP or ZeRO-1 (ZeRO-2/3 pad the lighter replicas to the heaviest's passes:
  no time saved); `dp_weights` from each replica's micro-batch time (hetero_price.dp_split).
TP (and so SP) never spans two types. The search ranks by the formula's step, then prices the
fastest again with the schedule simulator using each stage's own times, and plans the fastest type
alone (search.plan) to say what the slower cards add.
"""
from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from dataclasses import dataclass, field

from ...core.choices import AC_MODES
from ...core.layout import Layout
from ..cluster import Cluster, Group, tp_span
from ..hardware import HardwareError
from .price import (PIPE_SCHEDULES, Priced, block_costs, dp_split, price_data, price_pipeline, speed_split,
                           unit_groups)
from ..cost.memory import stage_memory
from ..cost.options import Options
from ..search.ranked import MIN_CP_CHUNK, divisors, zero_options, plan
from ..spec import PlanError, Shape, Spec, check


BOUNDED = object()  # a price function's answer for a layout its compute alone rules out


@dataclass
class MixedPlan:
    cluster: Cluster
    ranked: list[Priced]
    counts: Counter
    alone_group: Group
    alone: dict | None          # search.plan's best row on the fastest type alone; None: nothing fits
    global_batch: int
    seq_len: int
    elapsed_s: float = 0.0
    reasons: Counter = field(default_factory=Counter)


@dataclass
class _Mixed:
    """What every candidate of one mixed search shares."""
    shape: Shape
    cluster: Cluster
    o: Options
    fx: dict
    G: int
    knobs: dict
    keep: int
    counts: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    heap: list = field(default_factory=list)   # (-step, tie, Priced)
    tie: int = 0

    def want(self, key: str, value) -> bool:
        return key not in self.fx or self.fx[key] == value

    def reject(self, reason: str, n: int = 1) -> None:
        self.counts["candidates"] += n
        self.counts["oom" if reason.startswith("out of memory") else "invalid"] += n
        self.reasons[reason] += n

    def push(self, p: Priced) -> None:
        self.counts["candidates"] += 1
        self.counts["fit"] += 1
        self.tie += 1
        item = (-p.step_s, -self.tie, p)
        if len(self.heap) < self.keep:
            heapq.heappush(self.heap, item)
        elif p.step_s < -self.heap[0][0]:
            heapq.heapreplace(self.heap, item)

    @property
    def node(self) -> int:  # TP stays inside a node of every type
        return min(g.gpu.gpus_per_node for g in self.cluster.groups)

    def tp_ok(self, tp: int) -> bool:
        a = self.shape.args
        if not self.want("tp", tp):
            return False
        if tp > self.node or a.n_heads % tp or a.ffn_dim % tp or (a.n_kv_heads % tp and tp % a.n_kv_heads):
            self.reject("tp larger than a node or not dividing the heads / ffn_dim")
            return False
        return True

    def choices(self, zero: int) -> list[tuple[str, str]]:
        """(AC, offload) in the order worth trying: AC fastest first, then the same with optimizer offload."""
        offs = ["none"] + (["optimizer"] if zero and self.knobs["optim"] != "muon" else [])
        return [(ac, off) for off in offs if self.want("offload", off) for ac in AC_MODES if self.want("ac", ac)]


def plan_mixed(shape: Shape, cluster: Cluster, seq_len: int, tokens: int, precision: str = "bf16", top: int = 10,
               fixed: dict | None = None, o: Options | None = None, optim: str = "adamw",
               knobs: dict | None = None) -> MixedPlan:
    """Rank the mixed layouts of `cluster` by step time (the same global batch as the fastest type
    alone, so step time orders throughput too), and plan the fastest type alone for the comparison."""
    o, fx, t0 = o or Options(), fixed or {}, time.perf_counter()
    if seq_len < 1 or tokens < seq_len or tokens % seq_len:
        raise PlanError(f"--global-batch-tokens: {tokens} is not a positive multiple of --seq-len {seq_len}")
    if "tp" in fx:
        try:
            tp_span(cluster, fx["tp"], key="--fix tp")
        except HardwareError as e:
            raise PlanError(str(e)) from None
    ctx = _Mixed(shape, cluster, o, fx, tokens // seq_len, dict(precision=precision, seq_len=seq_len, optim=optim,
                                                                **(knobs or {})), max(3 * top, 20))
    _pipelines(ctx)
    _data(ctx)
    best = sorted((x[2] for x in ctx.heap), key=lambda p: p.step_s)
    ranked = []
    for p in best:  # the formula ranked them; the simulator, with each stage's own times, prices them
        ranked.append(price_pipeline(shape, p.spec, cluster, o, simulate=True) if p.spans == "pp" else p)
    ranked.sort(key=lambda p: (p.step_s, max(t["bytes"] for t in p.per_type)))
    fast = cluster.fastest()
    alone = plan(shape, fast.gpu, fast.count, seq_len, tokens, precision, 1, fx, o, optim, knobs)
    return MixedPlan(cluster, ranked[:top], ctx.counts, fast, alone.ranked[0] if alone.ranked else None, ctx.G,
                     seq_len, time.perf_counter() - t0, ctx.reasons)


def _lower_bound(ctx: _Mixed, s: Spec, cards: list[Group]) -> float:
    """The step can be no shorter than its compute spread perfectly over the cards (each unit of ranks
    doing work in proportion to its speed): micro-batches × blocks over the sum of the units' speeds."""
    per_unit = [block_costs(ctx.shape, s, g.gpu, ctx.o) for g in cards]
    L = ctx.shape.args.n_layers
    if s.pp_enabled:  # one micro-batch's blocks over the stages, every micro-batch through every stage
        return s.accum * L / sum(1.0 / b for b, _ in per_unit)
    return ctx.G / s.micro_batch * L / sum(1.0 / b for b, _ in per_unit)


def _first_fit(ctx: _Mixed, base: Spec, cards: list[Group], price) -> bool:
    """Price the fastest (AC, offload) choice of `base` that fits (`price` returns a Priced or None);
    False when none does (a larger micro-batch will not fit either). A layout whose compute alone
    cannot beat the `keep` fastest so far is not priced (the search's own bound, search._rank)."""
    choices = ctx.choices(base.zero)
    if choices and len(ctx.heap) >= ctx.keep:
        first = dataclasses.replace(base, ac=choices[0][0], offload=choices[0][1])
        if _lower_bound(ctx, first, cards) >= -ctx.heap[0][0]:
            ctx.counts["bounded"] += 1
            return True
    for ac, off in choices:
        spec = dataclasses.replace(base, ac=ac, offload=off)
        p = price(spec)
        if p is BOUNDED:  # the slower AC choices and offload are bounded too
            ctx.counts["bounded"] += 1
            return True
        if p is not None and p.fits:
            ctx.push(p)
            return True
    ctx.reject("out of memory even with the most memory-saving AC / offload")
    return False


def _stage_degrees(ctx: _Mixed, pp: int):
    """(tp, cp, dp) inside a stage of world/pp ranks."""
    S, seq = ctx.cluster.world // pp, ctx.knobs["seq_len"]
    for tp in divisors(S):
        if not ctx.tp_ok(tp):
            continue
        for cp in divisors(S // tp):
            if not ctx.want("cp", cp):
                continue
            if cp > 1 and (seq % (2 * cp) or seq // cp < MIN_CP_CHUNK):
                ctx.reject(f"cp leaves fewer than {MIN_CP_CHUNK} tokens per rank or does not split seq_len in 2·cp")
                continue
            dp = S // (tp * cp)
            if ctx.want("dp", dp) and ctx.G % dp == 0:
                yield tp, cp, dp


def _pipelines(ctx: _Mixed) -> None:
    """Pipelines whose stages are each one type, their blocks split by speed and memory."""
    shape, cluster, W = ctx.shape, ctx.cluster, ctx.cluster.world
    for pp in divisors(W):
        if pp < 2 or not ctx.want("pp", pp) or pp > shape.args.n_layers:
            continue
        S = W // pp
        if any(g.count % S for g in cluster.groups):
            ctx.reject("a pipeline stage would hold two device types")
            continue
        cards = unit_groups(cluster, S)
        for tp, cp, dp in _stage_degrees(ctx, pp):
            deg = Layout(dp=dp, tp=tp, pp=pp, cp=cp)
            sps = [s for s in ((False, True) if tp > 1 else (False,)) if ctx.want("sp", s)]
            zeros = [(z, g) for z, g in zero_options(deg, ctx.node) if ctx.want("zero", z) and ctx.want("zero_group", g)]
            for sched in PIPE_SCHEDULES:
                if not ctx.want("pp_schedule", sched) or not ctx.want("pp_virtual", 1):
                    continue
                for sp in sps:
                    for zero, g in zeros:
                        for mb in divisors(ctx.G // dp):
                            if not ctx.want("micro_batch", mb):
                                continue
                            base = Spec(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, zero_group=g, sp=sp, micro_batch=mb,
                                        accum=ctx.G // dp // mb, pp_schedule=sched, **ctx.knobs)
                            if not _first_fit(ctx, base, cards, lambda s: _split_and_price(ctx, s, cards)):
                                break


def _split_and_price(ctx: _Mixed, s: Spec, cards: list[Group]) -> Priced | None:
    split = speed_split(ctx.shape, s, cards, ctx.o)
    if split is None:
        return None
    s = dataclasses.replace(s, pp_layers=split)
    costs = [block_costs(ctx.shape, s, g.gpu, ctx.o) for g in cards]
    busiest = s.accum * max(k * b + (h if r == s.pp - 1 else 0.0) for r, (k, (b, h)) in enumerate(zip(split, costs)))
    if len(ctx.heap) >= ctx.keep and busiest >= -ctx.heap[0][0]:  # its busiest stage's compute alone is slower
        return BOUNDED
    try:
        check(ctx.shape, s)
    except PlanError:
        ctx.reject("invalid pipeline split")
        return None
    return price_pipeline(ctx.shape, s, ctx.cluster, ctx.o)


def _data(ctx: _Mixed) -> None:
    """Data parallelism across types: replicas of tp ranks of one type, weighted by speed."""
    shape, cluster, W, G = ctx.shape, ctx.cluster, ctx.cluster.world, ctx.G
    if not (ctx.want("pp", 1) and ctx.want("cp", 1) and ctx.want("ep", 1)):
        return
    if not (ctx.want("zero", 0) or ctx.want("zero", 1)):
        ctx.reject("data parallelism across types runs DDP or ZeRO-1 (ZeRO-2/3 pad the lighter replicas)")
        return
    for tp in divisors(W):
        if not ctx.tp_ok(tp):
            continue
        if any(g.count % tp for g in cluster.groups):
            ctx.reject("a TP group would span two device types")
            continue
        dp = W // tp
        if not ctx.want("dp", dp):
            continue
        cards = unit_groups(cluster, tp)
        for sp in [s for s in ((False, True) if tp > 1 else (False,)) if ctx.want("sp", s)]:
            for zero in (0, 1):  # ZeRO-2/3 pad the lighter replicas: no time saved (docs/heterogeneous.md)
                if not ctx.want("zero", zero):
                    continue
                for mb in divisors(G):
                    if not ctx.want("micro_batch", mb) or G // mb < dp:
                        continue
                    base = Spec(dp=dp, tp=tp, zero=zero, zero_group=dp, sp=sp, micro_batch=mb, accum=1, **ctx.knobs)
                    if not _first_fit(ctx, base, cards, lambda s: _weigh_and_price(ctx, s, cards)):
                        break


def _weigh_and_price(ctx: _Mixed, s: Spec, cards: list[Group]) -> Priced | None:
    """The layout `s` with each replica's micro-batches in proportion to its card's speed."""
    groups = list(ctx.cluster.groups)
    replicas = [sum(1 for c in cards if c is g) for g in groups]
    per_mb = []
    for g in groups:
        block, head = block_costs(ctx.shape, s, g.gpu, ctx.o)
        per_mb.append(ctx.shape.args.n_layers * block + head)
    kept = [(g, n, t) for g, n, t in zip(groups, replicas, per_mb) if n]
    counts = dp_split(ctx.G // s.micro_batch, [n for _, n, _ in kept], [t for _, _, t in kept])
    if counts is None:
        ctx.reject("the global batch has fewer micro-batches than replicas")
        return None
    of = {id(g): a for (g, _, _), a in zip(kept, counts)}
    accums = tuple(of[id(c)] for c in cards)
    s = dataclasses.replace(s, accum=max(accums), dp_accums=accums)
    for g in groups:  # memory first: the step is not worth pricing on a card it does not fit
        one = dataclasses.replace(s, accum=of.get(id(g), 1), dp_accums=())
        if of.get(id(g)) and stage_memory(ctx.shape, one, "only", ctx.o).total() > ctx.o.usable(g.gpu):
            return None
    return price_data(ctx.shape, s, ctx.cluster, ctx.o)
