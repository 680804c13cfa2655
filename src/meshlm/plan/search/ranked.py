"""Enumerate every layout of N GPUs, drop the invalid and the ones that do not fit, rank the rest.

Cheap checks come first and cut whole subtrees: divisibility per degree, then memory (memory.stage_memory,
the model `meshlm estimate` prices with; it only grows with the micro-batch size, so the micro-batch
loop stops at the first size where nothing fits), then
a compute-only lower bound on the step time that skips the full time model for layouts that cannot
reach the current top. Within one layout, AC modes and optimizer offload only trade time for memory,
so the fastest variant that fits is ranked and the others count as dominated.
"""
from __future__ import annotations

import time
from collections import Counter
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from ...core.layout import Layout
from ..cost.estimate import estimate
from ..hardware import GPU
from ..cost.options import Options
from ..spec import AC_MODES, PlanError, Shape, allgather_mask, check
from .grouped import search_group
from .workers import map_ordered, search_all

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


def divisors(n: int) -> list[int]:
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
    micro: dict = field(default_factory=dict)  # group_lower_bound's micro_times, by what varies in a search

    @property
    def optim(self) -> str:  # optim.name: "muon" is priced (plan/cost/muon.py) and runs without offload
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
    processes: int = 1  # the processes the search ran in (plan/search/workers.py)


def plan(shape: Shape, gpu: GPU, n_gpus: int, seq_len: int, global_batch_tokens: int, precision: str = "bf16",
         top: int = 10, fixed: dict | None = None, o: Options | None = None, optim: str = "adamw",
         knobs: dict | None = None, keep: int | None = None,
         order: Callable[[list[dict]], list[int]] | None = None) -> PlanResult:
    """Rank every valid layout by predicted tokens/s per GPU; the best `top` come back as estimates.
    `optim`: optim.name, priced in memory and time; `knobs`: spec.search_knobs of a config, kept as
    given (default: the Spec's defaults); `keep`: how many of the fastest are estimated in full (default
    3 × top); `order`: re-ranks those estimates (indices, best first: plan/search/objective.py)."""
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

    ctx = _Search(shape, gpu, o, fx, want, reject, counts, [], keep or max(3 * top, 20), [x for x in AC_MODES if want("ac", x)],
                  o.usable(gpu), global_batch_tokens // seq_len,
                  dict(precision=precision, seq_len=seq_len, optim=optim, **(knobs or {})), reasons=reasons,
                  examples=examples)
    processes = search_all(ctx, list(enumerate(_degrees(ctx, n_gpus))), _search_part_local)
    kept = sorted(ctx.heap, key=lambda x: -x[0])
    for item in kept:
        check(shape, item[2])  # the search's own checks must agree with the estimator's
    found = map_ordered(lambda spec: estimate(shape, spec, gpu, cp_core(o, spec, fx)[1], validate=False),
                        [spec for _, _, spec, _ in kept])
    rows = [(r, (spec, total, -neg_step)) for r, (neg_step, _, spec, total) in zip(found, kept)]
    rows.sort(key=lambda x: (x[0]["step_s"], x[0]["per_gpu"]["total"]))
    counts["ranked_in_detail"] = len(rows)
    if order is not None:
        rows = [rows[i] for i in order([r for r, _ in rows])]
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
    for tp in divisors(n_gpus):
        if not want("tp", tp):
            continue
        if tp > gpn and "tp" not in fx:
            reject(f"tp > {gpn} GPUs per node (TP stays on NVLink)")
            continue
        if a.n_heads % tp or a.ffn_dim % tp or (a.n_kv_heads % tp and tp % a.n_kv_heads):
            reject("tp does not divide the heads / kv heads / ffn_dim")
            continue
        for cp in divisors(n_gpus // tp):
            if not want("cp", cp):
                continue
            if cp > 1 and (seq_len % (2 * cp) or seq_len // cp < MIN_CP_CHUNK):
                reject(f"cp leaves fewer than {MIN_CP_CHUNK} tokens per rank or does not split seq_len in 2·cp")
                continue
            for pp in divisors(n_gpus // (tp * cp)):
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


def zero_options(deg: Layout, gpn: int) -> list[tuple[int, int]]:
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
    """All layouts with these degrees: schedules × sp, each a group of ZeRO × ep variants that
    plan/search/grouped.py sizes, prices and ranks."""
    shape, fx, want = ctx.shape, ctx.fx, ctx.want
    sps = [s for s in ((False, True) if deg.tp_enabled else (False,)) if want("sp", s)]
    zeros = [(z, g) for z, g in zero_options(deg, ctx.gpu.gpus_per_node) if want("zero", z) and want("zero_group", g)]
    eps = [1] if not shape.moe else [e for e in divisors(shape.num_experts) if want("ep", e)]
    # nvme offload frees the same GPU memory as optimizer offload, only slower: searched only when fixed
    offs = [x for x in ("none", "optimizer", "nvme") if want("offload", x) and (x != "nvme" or fx.get("offload") == "nvme")
            and (x == "none" or ctx.optim != "muon")]  # Muon runs without offload
    cp_impl, o = cp_core(ctx.o, deg, fx)
    if cp_impl is None:
        ctx.reject("a document mask under cp needs cp_impl = allgather or ulysses")
        return
    b_local = ctx.G // deg.dp
    mbs = [mb for mb in divisors(b_local) if want("micro_batch", mb)]
    for sched, v, split in _pipelines(deg, shape.args.n_layers, fx):
        for sp in sps:
            bases = []  # one group: its variants in the loop's order (plan/search/grouped.py)
            for zero, g in zeros:
                for ep in eps:
                    if ep > 1 and ((g if zero else 1) * deg.cp) % ep:
                        bases.append(None)
                        continue
                    bases.append(dict(dp=deg.dp, tp=deg.tp, pp=deg.pp, cp=deg.cp, ep=ep, zero=zero, zero_group=g,
                                      sp=sp, pp_schedule=sched, pp_virtual=v, pp_layers=split, cp_impl=cp_impl,
                                      **ctx.knobs, **_zeropp(fx, zero, g * deg.cp)))
            if bases:
                search_group(ctx, bases, o, offs, b_local, mbs)
