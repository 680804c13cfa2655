"""Enumerate every layout of N GPUs, drop the invalid and the ones that do not fit, rank the rest.

Cheap checks come first and cut whole subtrees: divisibility per degree, then memory (which only grows
with the micro-batch size, so the micro-batch loop stops at the first size where nothing fits), then
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
from .comm import link
from .estimate import Options, bubble_formula, estimate, micro_times, time_model
from .hardware import GIB, GPU
from .memory import pipeline_roles, stage_totals
from .spec import AC_MODES, PlanError, Shape, Spec, allgather_mask, check

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
    keys, the batch, and the running tallies and heap of the fastest layouts so far."""
    shape: Shape
    gpu: GPU
    o: Options
    fx: dict
    want: Callable[[str, object], bool]   # is this value allowed for this key (not fixed otherwise)
    reject: Callable[..., None]           # count a rejected candidate and why
    counts: Counter
    heap: list                            # (-step_s, tie, spec): the `keep` fastest so far
    keep: int
    acs: list                             # AC modes to try
    usable: float                         # bytes a rank may use
    G: int                                # global batch, sequences
    seq_len: int
    precision: str
    tie: int = 0
    optim: str = "adamw"                  # optim.name: "muon" is priced (plan/muon.py) and runs without offload


@dataclass(frozen=True)
class _Degrees:
    tp: int
    cp: int
    pp: int
    dp: int


@dataclass
class PlanResult:
    ranked: list[dict]
    counts: Counter
    reasons: Counter
    examples: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    global_batch: int = 0


def plan(shape: Shape, gpu: GPU, n_gpus: int, seq_len: int, global_batch_tokens: int, precision: str = "bf16",
         top: int = 10, fixed: dict | None = None, o: Options | None = None, optim: str = "adamw") -> PlanResult:
    """Rank every valid layout by predicted tokens/s per GPU; the best `top` come back as estimates.
    `optim`: optim.name, priced in memory and time."""
    o = o or Options()
    t0 = time.perf_counter()
    fx = fixed or {}
    a = shape.args
    if n_gpus < 1:
        raise PlanError(f"--gpus: must be >= 1, got {n_gpus}")
    if seq_len < 1 or global_batch_tokens < seq_len or global_batch_tokens % seq_len:
        raise PlanError(f"--global-batch-tokens: {global_batch_tokens} is not a positive multiple of "
                        f"--seq-len {seq_len}")
    if optim == "muon" and fx.get("offload", "none") != "none":
        raise PlanError(f"--fix offload={fx['offload']}: optim.name = muon runs without optimizer offload")
    G = global_batch_tokens // seq_len
    usable = o.usable(gpu)
    gpn = gpu.gpus_per_node
    counts: Counter = Counter()
    reasons: Counter = Counter()
    examples: dict = {}
    keep = max(3 * top, 20)

    def reject(reason: str, n: int = 1, example: str | None = None) -> None:
        # every candidate is counted once: fit, oom or invalid add up to "candidates" (dominated is part of fit)
        counts["candidates"] += n
        counts["invalid" if not reason.startswith("out of memory") else "oom"] += n
        reasons[reason] += n
        if example and reason not in examples:
            examples[reason] = example

    def want(key, value) -> bool:
        return key not in fx or fx[key] == value

    ctx = _Search(shape, gpu, o, fx, want, reject, counts, [], keep, [x for x in AC_MODES if want("ac", x)],
                  usable, G, seq_len, precision, optim=optim)
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
                if G % dp:
                    reject("dp does not divide the global batch (sequences)")
                    continue
                _layouts(ctx, _Degrees(tp, cp, pp, dp))
    best = sorted(ctx.heap, key=lambda x: -x[0])
    ranked = []
    for _, _, spec in best:
        check(shape, spec)  # the search's own checks must agree with the estimator's
        ranked.append(estimate(shape, spec, gpu, cp_core(o, spec.cp, fx)[1], validate=False))
    ranked.sort(key=lambda r: (r["step_s"], r["per_gpu"]["total"]))
    counts["ranked_in_detail"] = len(ranked)
    return PlanResult(ranked[:top], counts, reasons, examples, time.perf_counter() - t0, G)


def cp_core(o: Options, cp: int, fx: dict) -> tuple[str | None, Options]:
    """(parallel.cp_impl, the options to price with) of a layout: with a document mask or flex
    (`o.attn_mask` not causal) the ring cannot run, so CP layouts use the all-gather core unless
    Ulysses is pinned (its core attends the whole sequence under the mask it has without CP); an
    all-gather layout is priced with its own mask (spec.allgather_mask); None: a pinned ring."""
    impl = fx.get("cp_impl", "ring")
    if cp == 1 or (o.attn_mask == "causal" and impl != "allgather") or impl == "ulysses":
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


def _zero_options(dp: int, tp: int, cp: int, gpn: int) -> list[tuple[int, int]]:
    if dp == 1:
        return [(0, 1), (1, 1)]  # ZeRO-1 on one rank is what makes optimizer offload possible
    out = [(0, dp), (1, dp), (2, dp), (3, dp)]
    for k in (1, 2, 4, 8):  # HSDP: shard within 1, 2, 4 or 8 nodes, replicate across
        g = gpn * k // (tp * cp) if (gpn * k) % (tp * cp) == 0 else 0
        if 1 < g < dp and dp % g == 0:
            out.append((3, g))
    return out


def _layouts(ctx: _Search, deg: _Degrees) -> None:
    """All layouts with these degrees: schedules × ZeRO × micro-batch × (AC, offload)."""
    shape, gpu, o, fx, want, reject, counts = ctx.shape, ctx.gpu, ctx.o, ctx.fx, ctx.want, ctx.reject, ctx.counts
    heap, keep, acs, usable, G, seq_len, precision = ctx.heap, ctx.keep, ctx.acs, ctx.usable, ctx.G, ctx.seq_len, \
        ctx.precision
    tp, cp, pp, dp = deg.tp, deg.cp, deg.pp, deg.dp
    a = shape.args
    b_local = G // dp
    stages = pipeline_roles(pp)
    sps = [s for s in ((False, True) if tp > 1 else (False,)) if want("sp", s)]
    zeros = [(z, g) for z, g in _zero_options(dp, tp, cp, gpu.gpus_per_node)
             if want("zero", z) and want("zero_group", g)]
    eps = [1] if not shape.moe else [e for e in _divisors(shape.num_experts) if want("ep", e)]
    mbs = [mb for mb in _divisors(b_local) if want("micro_batch", mb)]
    # nvme offload frees the same GPU memory as optimizer offload, only slower: searched only when fixed
    offs = [x for x in ("none", "optimizer", "nvme") if want("offload", x) and (x != "nvme" or fx.get("offload") == "nvme")
            and (x == "none" or ctx.optim != "muon")]  # Muon runs without offload
    cp_impl, o = cp_core(o, cp, fx)
    if cp_impl is None:
        reject("a document mask under cp needs cp_impl = allgather or ulysses")
        return
    for (sched, v), split in ((sv, x) for sv in _schedules(pp, a.n_layers, fx)
                              for x in (_splits(a.n_layers, pp * sv[1], fx) if pp > 1 else [()])):
        for sp in sps:
            for zero, g in zeros:
                for ep in eps:
                    if ep > 1 and ((g if zero else 1) * cp) % ep:
                        reject("ep does not divide dp_shard×cp")
                        continue
                    for i, mb in enumerate(mbs):
                        m = b_local // mb
                        if sched == "interleaved" and m % pp:
                            reject("interleaved needs microbatches divisible by pp")
                            continue
                        parts = [stage_totals(shape, st, tp, sp, cp, pp, v, ep, zero, g, dp, mb, m, sched,
                                              seq_len, precision, cp_impl, 25.0, o.flash, o.attn_math_bytes,
                                              o.compiled, split, o.loss_chunks, o.attn_mask, ctx.optim,
                                              o.recompute_gemms)
                                 for st in stages]
                        variants = []
                        for off in offs:
                            if off != "none" and zero == 0:
                                continue
                            for ac in acs:
                                total = max(b + (0.0 if off != "none" else opt) + acts[ac]
                                            for b, opt, acts in parts)
                                variants.append((total <= usable, ac, off, total))
                        fits = [x for x in variants if x[0]]
                        if not fits:
                            need = min(x[3] for x in variants)
                            left = len(mbs) - i  # larger micro-batches need even more memory
                            reject("out of memory even with the most memory-saving AC / offload", left * len(variants),
                                   f"tp{tp} cp{cp} pp{pp} dp{dp} zero{zero} g{g} {sched} mb{mb}: needs "
                                   f"{need / GIB:.1f} GiB > usable {usable / GIB:.1f} GiB")
                            break
                        counts["candidates"] += len(fits)
                        counts["fit"] += len(fits)
                        if len(fits) < len(variants):
                            reject("out of memory with this AC / offload (a more memory-saving one fits)",
                                   len(variants) - len(fits))
                        # fastest AC without offload; with offload only an AC cheaper than that one
                        order = {x: j for j, x in enumerate(AC_MODES)}
                        plain = [x for x in fits if x[2] == "none"]
                        chosen = plain[:1]
                        limit = order[plain[0][1]] if plain else len(AC_MODES)
                        chosen += [x for x in fits if x[2] != "none" and order[x[1]] < limit][:1]
                        counts["dominated"] += len(fits) - len(chosen)
                        for _, ac, off, _ in chosen:
                            ctx.tie += 1
                            lb = _lower_bound(shape, gpu, o, tp, cp, pp, v, sched, seq_len, mb, m, ac, stages,
                                              precision, split, sp, ep)
                            if len(heap) >= keep and lb >= -heap[0][0]:
                                counts["bounded"] += 1
                                continue
                            spec = Spec(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, zero_group=g, sp=sp,
                                        pp_schedule=sched, pp_virtual=v, micro_batch=mb, accum=m, ac=ac,
                                        offload=off, precision=precision, seq_len=seq_len, cp_impl=cp_impl,
                                        pp_layers=split, optim=ctx.optim, **_zeropp(fx, zero, g * cp))
                            step = time_model(shape, spec, gpu, o, simulate=False)["step_s"]
                            counts["timed"] += 1
                            item = (-step, ctx.tie, spec)
                            if len(heap) < keep:
                                heapq.heappush(heap, item)
                            elif step < -heap[0][0]:
                                heapq.heapreplace(heap, item)


def _lower_bound(shape, gpu, o, tp, cp, pp, v, sched, seq_len, mb, m, ac, stages, precision,
                 split: tuple = (), sq: bool = False, ep: int = 1) -> float:
    """Compute time plus the bandwidth term of the (never hidden) TP reductions; no other communication,
    optimizer or offload: never above the full time model's step time."""
    from .memory import _stage_params_cached
    tokens = mb * seq_len / cp  # sq: sequence parallelism (sp below is the stage's parameters)
    tp_s = 0.0
    if tp > 1:
        e = HELD[precision].act
        tp_s = 2 * (tp - 1) / tp * e * shape.args.dim * tokens / (link(gpu, tp, 1)[1] * o.comm_efficiency)
    full, busy = [], []
    for st in stages:  # the real worst stage is unknown here: bound with the least of the per-stage bounds
        sp = _stage_params_cached(shape, Spec(tp=tp, pp=pp, pp_virtual=v, pp_schedule=sched, pp_layers=split), st)
        mt = micro_times(shape, tp, sq, ep, cp, seq_len, sp.layers, sp.head, mb,
                         "none" if ac == "selective" and cp > 1 else ac, precision, gpu, o)
        t_f, t_b, t_rc = mt["t_f"], mt["t_b"], mt["t_rc"]
        x = sp.layers * 2 * (3 if ac == "full" else 2) * tp_s
        f, b = t_f + x / 2, t_b + t_rc + x / 2
        busy.append(m * (f + b))
        full.append(m * (f + b) * (1 + bubble_formula(sched, pp, m, v, f, b, t_b / 2)))
    return max(min(full), max(busy))
