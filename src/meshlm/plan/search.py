"""Enumerate every layout of N GPUs, drop the invalid and the ones that do not fit, rank the rest.

Cheap checks come first and cut whole subtrees: divisibility per degree, then memory (memory.stage_memory,
the model `meshlm estimate` prices with; it only grows with the micro-batch size, so the micro-batch
loop stops at the first size where nothing fits), then
a compute-only lower bound on the step time that skips the full time model for layouts that cannot
reach the current top. Within one layout, AC modes and optimizer offload only trade time for memory,
so the fastest variant that fits is ranked and the others count as dominated.
"""
from __future__ import annotations

import heapq
import time
from collections import Counter
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from ..choices import HELD
from ..layout import Layout
from .comm import ep_collectives, link
from .estimate import bubble_formula, estimate, micro_times, time_model
from .hardware import GIB, GPU
from .memory import stage_memory, state_floor
from .options import Options
from .spec import AC_MODES, PlanError, Shape, Spec, allgather_mask, check
from .stages import pipeline_roles, stage_params
from .workers import search_all

FIXABLE = {"dp": int, "tp": int, "pp": int, "cp": int, "ep": int, "zero": int, "zero_group": int,
           "sp": lambda v: str(v).lower() in ("1", "true", "yes", "on"), "pp_schedule": str,
           "pp_virtual": int, "micro_batch": int, "ac": str, "offload": str, "cp_impl": str,
           "quantize_weights": lambda v: str(v).lower() in ("1", "true", "yes", "on"), "hpz_group": int,
           "quantize_grads": lambda v: str(v).lower() in ("1", "true", "yes", "on")}
ZEROPP = ("quantize_weights", "hpz_group", "quantize_grads")
VIRTUAL = (2, 3, 4, 6, 8)
MIN_CP_CHUNK = 256  # tokens per CP rank below which ring attention is all latency


def _zeropp(fx: dict, zero: int, shard: int) -> dict:
    """ZeRO++ keys fixed by the user (`--fix hpz_group=8`), on the ZeRO-3 layouts they fit; the search
    does not try them on its own: they trade accuracy (qwZ, qgZ) or memory (hpZ) for bytes."""
    if zero != 3:
        return {}
    out = {k: fx[k] for k in ZEROPP if k in fx}
    if out.get("hpz_group") and shard % out["hpz_group"]:
        out.pop("hpz_group")
    return out


def parse_fix(items: list[str]) -> dict:
    """['tp=8', 'zero=3'] -> {'tp': 8, 'zero': 3}; one-line PlanError on a bad item."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise PlanError(f"--fix: expected KEY=VALUE, got '{it}'")
        k, v = (x.strip() for x in it.split("=", 1))
        k = k.split(".")[-1]
        if k not in FIXABLE:
            raise PlanError(f"--fix: unknown key '{k}' (known: {', '.join(FIXABLE)})")
        try:
            out[k] = FIXABLE[k](v)
        except ValueError:
            raise PlanError(f"--fix: {k} expects a number, got '{v}'") from None
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class _Search:
    """What every layout of one search shares: the model, the device and options, the user's fixed
    keys, the knobs every Spec gets, and the running tallies and heap of the fastest layouts so far."""
    shape: Shape
    gpu: GPU
    o: Options
    fx: dict
    want: Callable[[str, object], bool]   # is this value allowed for this key (not fixed otherwise)
    reject: Callable[..., None]           # count a rejected candidate and why
    counts: Counter
    heap: list                            # (-step_s, tie, spec, bytes): the `keep` fastest so far
    keep: int
    acs: list                             # AC modes to try
    usable: float                         # bytes a rank may use
    G: int                                # global batch, sequences
    # Spec fields the search does not vary: precision, seq_len, optim and spec.SEARCH_KNOBS (a config's
    # bucket_mb, reduce_dtype, offload_buffer_mb), so that it prices what `meshlm estimate` would
    knobs: dict
    tie: int = 0
    reasons: Counter = field(default_factory=Counter)  # why candidates were rejected (reject's tallies)
    examples: dict = field(default_factory=dict)       # one example of each reason
    micro: dict = field(default_factory=dict)  # _lower_bound's micro_times, by what varies in a search

    @property
    def optim(self) -> str:  # optim.name: "muon" is priced (plan/muon.py) and runs without offload
        return self.knobs["optim"]


@dataclass
class PlanResult:
    ranked: list[dict]
    counts: Counter
    reasons: Counter
    examples: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    global_batch: int = 0
    # (Spec, bytes, step_s) of each ranked layout as the search priced it: its memory on the worst rank
    # (stage_memory, as estimate) and its step with the bubble formula (estimate's with simulate=False)
    prices: list = field(default_factory=list)
    processes: int = 1  # the processes the search ran in (plan/workers.py)


def plan(shape: Shape, gpu: GPU, n_gpus: int, seq_len: int, global_batch_tokens: int, precision: str = "bf16",
         top: int = 10, fixed: dict | None = None, o: Options | None = None, optim: str = "adamw",
         knobs: dict | None = None) -> PlanResult:
    """Rank every valid layout by predicted tokens/s per GPU; the best `top` come back as estimates.
    `optim`: optim.name, priced in memory and time; `knobs`: spec.search_knobs of a config, kept as
    given (default: the Spec's defaults)."""
    o = o or Options()
    t0 = time.perf_counter()
    fx = fixed or {}
    if n_gpus < 1:
        raise PlanError(f"--gpus: must be >= 1, got {n_gpus}")
    if seq_len < 1 or global_batch_tokens < seq_len or global_batch_tokens % seq_len:
        raise PlanError(f"--global-batch-tokens: {global_batch_tokens} is not a positive multiple of "
                        f"--seq-len {seq_len}")
    if optim == "muon" and fx.get("offload", "none") != "none":
        raise PlanError(f"--fix offload={fx['offload']}: optim.name = muon runs without optimizer offload")
    counts: Counter = Counter()
    reasons: Counter = Counter()
    examples: dict = {}

    def reject(reason: str, n: int = 1, example: str | None = None) -> None:
        # every candidate is counted once: fit, oom or invalid add up to "candidates" (dominated is part of fit)
        counts["candidates"] += n
        counts["invalid" if not reason.startswith("out of memory") else "oom"] += n
        reasons[reason] += n
        if example and reason not in examples:
            examples[reason] = example

    def want(key, value) -> bool:
        return key not in fx or fx[key] == value

    ctx = _Search(shape, gpu, o, fx, want, reject, counts, [], max(3 * top, 20), [x for x in AC_MODES if want("ac", x)],
                  o.usable(gpu), global_batch_tokens // seq_len,
                  dict(precision=precision, seq_len=seq_len, optim=optim, **(knobs or {})), reasons=reasons,
                  examples=examples)
    processes = search_all(ctx, list(enumerate(_degrees(ctx, n_gpus))), _search_part_local)
    rows = []
    for neg_step, _, spec, total in sorted(ctx.heap, key=lambda x: -x[0]):
        check(shape, spec)  # the search's own checks must agree with the estimator's
        r = estimate(shape, spec, gpu, cp_core(o, spec, fx)[1], validate=False)
        rows.append((r, (spec, total, -neg_step)))
    rows.sort(key=lambda x: (x[0]["step_s"], x[0]["per_gpu"]["total"]))
    counts["ranked_in_detail"] = len(rows)
    return PlanResult([r for r, _ in rows[:top]], counts, reasons, examples, time.perf_counter() - t0, ctx.G,
                      [p for _, p in rows[:top]], processes)


def _search_part_local(ctx: _Search, items: list) -> None:
    """The layouts of these (index, degrees): ties break in the serial search's order."""
    for i, deg in items:
        ctx.tie = i * 10**9
        _layouts(ctx, deg)


def _degrees(ctx: _Search, n_gpus: int):
    """Every (tp, cp, pp, dp) of n_gpus ranks that the model, the sequence and the batch allow, as
    Layouts; a degree that cannot work is counted once and its whole subtree skipped."""
    a, fx, want, reject = ctx.shape.args, ctx.fx, ctx.want, ctx.reject
    seq_len, gpn = ctx.knobs["seq_len"], ctx.gpu.gpus_per_node
    for tp in _divisors(n_gpus):
        if not want("tp", tp):
            continue
        if tp > gpn and "tp" not in fx:
            reject(f"tp > {gpn} GPUs per node (TP stays on NVLink)")
            continue
        if a.n_heads % tp or a.ffn_dim % tp or (a.n_kv_heads % tp and tp % a.n_kv_heads):
            reject("tp does not divide the heads / kv heads / ffn_dim")
            continue
        for cp in _divisors(n_gpus // tp):
            if not want("cp", cp):
                continue
            if cp > 1 and (seq_len % (2 * cp) or seq_len // cp < MIN_CP_CHUNK):
                reject(f"cp leaves fewer than {MIN_CP_CHUNK} tokens per rank or does not split seq_len in 2·cp")
                continue
            for pp in _divisors(n_gpus // (tp * cp)):
                if not want("pp", pp):
                    continue
                if pp > a.n_layers:
                    reject("pp > n_layers")
                    continue
                dp = n_gpus // (tp * cp * pp)
                if not want("dp", dp):
                    continue
                if ctx.G % dp:
                    reject("dp does not divide the global batch (sequences)")
                    continue
                yield Layout(dp=dp, tp=tp, pp=pp, cp=cp)


def cp_core(o: Options, layout: Layout, fx: dict) -> tuple[str | None, Options]:
    """(parallel.cp_impl, the options to price with) of a layout: with a document mask or flex
    (`o.attn_mask` not causal) the ring cannot run, so CP layouts use the all-gather core unless
    Ulysses is pinned (its core attends the whole sequence under the mask it has without CP); an
    all-gather layout is priced with its own mask (spec.allgather_mask); None: a pinned ring."""
    impl = fx.get("cp_impl", "ring")
    if not layout.cp_enabled or (o.attn_mask == "causal" and impl != "allgather") or impl == "ulysses":
        return impl, o
    if impl == "ring" and "cp_impl" in fx:
        return None, o
    return "allgather", dataclasses.replace(o, attn_mask=allgather_mask(o.attn_mask, o.attn_impl))


def _schedules(pp: int, n_layers: int, fx: dict) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)] + [("interleaved", v) for v in VIRTUAL if pp * v <= n_layers]
    out += [("zbv", 2)] if 2 * pp <= n_layers else []
    return [(s, v) for s, v in out if ("pp_schedule" not in fx or fx["pp_schedule"] == s)
            and ("pp_virtual" not in fx or fx["pp_virtual"] == v)]


def lighter_ends(n_layers: int, stages: int, fewer: int = 1) -> tuple[int, ...] | None:
    """A split with `fewer` blocks less on the first and the last stage than on the others (as Meta
    split Llama 3 405B: 126 layers over 16 stages as 7 + 14×8 + 7), the rest spread evenly; None
    when it cannot be built. The first rank holds the most micro-batches in flight and the last one
    the head, so this trades a little pipeline balance for memory where it is tightest."""
    if stages < 3:
        return None
    end = (n_layers - (stages - 2) * fewer) // stages
    if end < 1:
        return None
    base, extra = divmod(n_layers - 2 * end, stages - 2)
    return (end,) + tuple(base + (1 if i < extra else 0) for i in range(stages - 2)) + (end,)


def _splits(n_layers: int, stages: int, fx: dict) -> list[tuple]:
    """Stage splits to try: the runtime's balanced one, and the first and last stages one block lighter."""
    if "pp_layers" in fx:
        return [tuple(fx["pp_layers"])]
    out: list[tuple] = [()]
    light = lighter_ends(n_layers, stages)
    if light is not None:
        out.append(light)
    return out


def _pipelines(deg: Layout, n_layers: int, fx: dict) -> list[tuple[str, int, tuple]]:
    """(schedule, chunks per rank, stage split) of every pipeline to try with these degrees."""
    if not deg.pp_enabled:
        return [("1f1b", 1, ())]
    return [(sched, v, split) for sched, v in _schedules(deg.pp, n_layers, fx)
            for split in _splits(n_layers, deg.pp * v, fx)]


def _zero_options(deg: Layout, gpn: int) -> list[tuple[int, int]]:
    dp, tp, cp = deg.dp, deg.tp, deg.cp
    if not deg.dp_enabled:
        return [(0, 1), (1, 1)]  # ZeRO-1 on one rank is what makes optimizer offload possible
    out = [(0, dp), (1, dp), (2, dp), (3, dp)]
    for k in (1, 2, 4, 8):  # HSDP: shard within 1, 2, 4 or 8 nodes, replicate across
        g = gpn * k // (tp * cp) if (gpn * k) % (tp * cp) == 0 else 0
        if 1 < g < dp and dp % g == 0:
            out.append((3, g))
    return out


def _layouts(ctx: _Search, deg: Layout) -> None:
    """All layouts with these degrees: schedules × sp × ZeRO × ep, then `_micro_batches` of each."""
    shape, fx, want = ctx.shape, ctx.fx, ctx.want
    sps = [s for s in ((False, True) if deg.tp_enabled else (False,)) if want("sp", s)]
    zeros = [(z, g) for z, g in _zero_options(deg, ctx.gpu.gpus_per_node) if want("zero", z) and want("zero_group", g)]
    eps = [1] if not shape.moe else [e for e in _divisors(shape.num_experts) if want("ep", e)]
    # nvme offload frees the same GPU memory as optimizer offload, only slower: searched only when fixed
    offs = [x for x in ("none", "optimizer", "nvme") if want("offload", x) and (x != "nvme" or fx.get("offload") == "nvme")
            and (x == "none" or ctx.optim != "muon")]  # Muon runs without offload
    cp_impl, o = cp_core(ctx.o, deg, fx)
    if cp_impl is None:
        ctx.reject("a document mask under cp needs cp_impl = allgather or ulysses")
        return
    for sched, v, split in _pipelines(deg, shape.args.n_layers, fx):
        for sp in sps:
            for zero, g in zeros:
                for ep in eps:
                    if ep > 1 and ((g if zero else 1) * deg.cp) % ep:
                        ctx.reject("ep does not divide dp_shard×cp")
                        continue
                    base = dict(dp=deg.dp, tp=deg.tp, pp=deg.pp, cp=deg.cp, ep=ep, zero=zero, zero_group=g, sp=sp,
                                pp_schedule=sched, pp_virtual=v, pp_layers=split, cp_impl=cp_impl, **ctx.knobs,
                                **_zeropp(fx, zero, g * deg.cp))
                    _micro_batches(ctx, base, o, [(ac, off) for off in offs if off == "none" or zero for ac in ctx.acs])


def _micro_batches(ctx: _Search, base: dict, o: Options, choices: list[tuple[str, str]]) -> None:
    """Each micro-batch size of one layout: its memory on every pipeline role (stage_memory, as
    estimate) under each (AC, offload) choice, the fastest choices that fit timed. Memory only grows
    with the micro-batch, so the first size where nothing fits ends the loop."""
    b_local = ctx.G // base["dp"]
    mbs = [mb for mb in _divisors(b_local) if ctx.want("micro_batch", mb)]
    if not choices:  # offload fixed, but nothing to offload: zero = 0
        ctx.reject("offload needs a ZeRO stage that shards the optimizer (zero >= 1)", len(mbs))
        return
    floor = Spec(**base, micro_batch=1, accum=b_local)
    if mbs and floor.optim != "muon" and max(state_floor(ctx.shape, floor, st, choices) for st in pipeline_roles(floor.pp)) > ctx.usable:
        ctx.reject("out of memory even with the most memory-saving AC / offload", len(mbs) * len(choices),
                   f"tp{floor.tp} cp{floor.cp} pp{floor.pp} dp{floor.dp} zero{floor.zero} g{floor.zero_group} "
                   f"{floor.pp_schedule}: its weights, gradients and optimizer state alone exceed usable "
                   f"{ctx.usable / GIB:.1f} GiB")
        return
    for i, mb in enumerate(mbs):
        m = b_local // mb
        if base["pp_schedule"] == "interleaved" and m % base["pp"]:
            ctx.reject("interleaved needs microbatches divisible by pp")
            continue
        spec = Spec(**base, micro_batch=mb, accum=m)
        worst = _worst_totals(ctx, spec, o, choices)
        variants = [(total <= ctx.usable, ac, off, total) for (ac, off), total in zip(choices, worst)]
        fits = [x for x in variants if x[0]]
        if not fits:
            need = min(x[3] for x in variants)
            ctx.reject("out of memory even with the most memory-saving AC / offload", (len(mbs) - i) * len(variants),
                       f"tp{spec.tp} cp{spec.cp} pp{spec.pp} dp{spec.dp} zero{spec.zero} g{spec.zero_group} "
                       f"{spec.pp_schedule} mb{mb}: needs {need / GIB:.1f} GiB > usable {ctx.usable / GIB:.1f} GiB")
            break  # larger micro-batches need even more memory
        ctx.counts["candidates"] += len(fits)
        ctx.counts["fit"] += len(fits)
        if len(fits) < len(variants):
            ctx.reject("out of memory with this AC / offload (a more memory-saving one fits)", len(variants) - len(fits))
        chosen = _fastest(fits)
        ctx.counts["dominated"] += len(fits) - len(chosen)
        for _, ac, off, total in chosen:
            _rank(ctx, spec, ac, off, total, o)


def _worst_totals(ctx: _Search, spec: Spec, o: Options, choices: list[tuple[str, str]]) -> list[float]:
    """Each choice's bytes on the fullest pipeline role; the roles after one on which no choice fits
    are not priced (the answer, nothing fits, is already known)."""
    worst = None
    for st in pipeline_roles(spec.pp):
        totals = stage_memory(ctx.shape, spec, st, o).totals(choices)
        worst = totals if worst is None else [max(a, b) for a, b in zip(worst, totals)]
        if min(worst) > ctx.usable:
            break
    return worst


def _fastest(fits: list[tuple]) -> list[tuple]:
    """The (fits, ac, offload, bytes) worth timing: the fastest AC without offload, and with offload
    only an AC cheaper than that one (AC modes go fastest first, and offload only adds time)."""
    order = {x: j for j, x in enumerate(AC_MODES)}
    plain = [x for x in fits if x[2] == "none"]
    limit = order[plain[0][1]] if plain else len(AC_MODES)
    return plain[:1] + [x for x in fits if x[2] != "none" and order[x[1]] < limit][:1]


def _rank(ctx: _Search, spec: Spec, ac: str, off: str, total: float, o: Options) -> None:
    """Time one fitting layout unless its lower bound cannot reach the heap, and keep the fastest."""
    ctx.tie += 1
    heap = ctx.heap
    lb = _lower_bound(ctx, o, spec, ac)
    if len(heap) >= ctx.keep and lb >= -heap[0][0]:
        ctx.counts["bounded"] += 1
        return
    if (ac, off) != (spec.ac, spec.offload):
        spec = dataclasses.replace(spec, ac=ac, offload=off)
    step = time_model(ctx.shape, spec, ctx.gpu, o, simulate=False)["step_s"]
    ctx.counts["timed"] += 1
    item = (-step, ctx.tie, spec, total)
    if len(heap) < ctx.keep:
        heapq.heappush(heap, item)
    elif step < -heap[0][0]:
        heapq.heapreplace(heap, item)


def _lower_bound(ctx: _Search, o: Options, s: Spec, ac: str) -> float:
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
            mt = ctx.micro[key] = micro_times(shape, s.tp, s.sp, s.ep, s.cp, s.seq_len, sp.layers, sp.head,
                                              s.micro_batch, run_ac, s.precision, gpu, o)
        t_f, t_b, t_rc = mt["t_f"], mt["t_b"], mt["t_rc"]
        x = sp.layers * 2 * (3 if ac == "full" else 2) * tp_s + _ep_seconds(ctx, o, s, sp.layers, ac)
        f, b = t_f + x / 2, t_b + t_rc + x / 2
        busy.append(m * (f + b))
        full.append(m * (f + b) * (1 + bubble_formula(s.pp_schedule, s.pp, m, s.pp_virtual, f, b, t_b / 2)))
    return max(min(full), max(busy))


def _ep_seconds(ctx: _Search, o: Options, s: Spec, layers: int, ac: str) -> float:
    """One micro-batch's expert-parallel all-to-alls on a stage of `layers` blocks: never hidden
    (plan/estimate.py), so they belong in the bound; for a MoE model they are often the largest term."""
    if not s.ep_enabled:
        return 0.0
    key = ("ep", s.ep, s.tp, s.cp, s.micro_batch, layers, ac, s.precision, s.fp8_comm)
    got = ctx.micro.get(key)
    if got is None:
        step = ep_collectives(ctx.shape, s, layers, ac, ctx.gpu, o.comm_efficiency)  # linear in the accumulation
        got = ctx.micro[key] = sum(c.seconds for c in step) / s.accum
    return got
