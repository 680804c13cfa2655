"""The search's degrees dealt out to forked worker processes, one per core (plan/search/ranked.py): each searches
its share on its inherited copy of the search with its own heap of the fastest, and the heaps, counts
and reasons are merged. A layout one worker's bound drops is slower than that worker's `keep` fastest,
so it is not among the merged fastest either (docs/planner.md, "Workers and the state floor")."""
from __future__ import annotations

import heapq
import multiprocessing as mp
import os
import threading

_FORKED: tuple | None = None  # (search, run) a forked worker inherits (`search_all`); (fn, items): `map_ordered`


def _part(items: list) -> tuple:
    """A worker's share of the degrees, searched on its inherited copy of the search: what it found."""
    ctx, run = _FORKED
    for tally in (ctx.counts, ctx.reasons, ctx.examples):  # the parent's own (the degrees') stay there
        tally.clear()
    run(ctx, items)
    return ctx.heap, ctx.counts, ctx.reasons, ctx.examples


def _workers(n_degrees: int) -> int:
    """Processes for a search: the cores (MESHLM_PLAN_WORKERS overrides), one where forking is not
    possible (a daemon process, a platform without fork), not safe (another thread is running: a fork
    copies the locks it may hold, and a worker can wait on one forever, as one did under pytest's
    process pools, and the explorer serves from threads) or there is little to share out."""
    want = int(os.environ.get("MESHLM_PLAN_WORKERS", "0")) or (os.cpu_count() or 1)
    if (mp.current_process().daemon or "fork" not in mp.get_all_start_methods() or n_degrees < 8
            or threading.active_count() > 1):
        return 1
    return max(1, min(want, 16, n_degrees // 4))


def search_all(ctx, items: list, run) -> int:
    """`run(ctx, items)` over every (index, degrees) item, in this process or dealt round-robin to
    forked workers; `ctx` (search._Search) ends up holding the merged heap and tallies. Returns the
    number of processes that searched."""
    global _FORKED
    n = _workers(len(items))
    if n == 1:
        run(ctx, items)
        return 1
    _FORKED = (ctx, run)
    try:
        with mp.get_context("fork").Pool(n) as pool:
            parts = pool.map(_part, [items[k::n] for k in range(n)])
    finally:
        _FORKED = None
    for heap, counts, reasons, examples in parts:
        ctx.heap.extend(heap)
        ctx.counts.update(counts)
        ctx.reasons.update(reasons)
        for k, v in examples.items():
            ctx.examples.setdefault(k, v)
    # items are (-step, tie, spec, bytes): keep the fastest, the earlier found first among equals
    ctx.heap[:] = heapq.nlargest(ctx.keep, ctx.heap, key=lambda x: (x[0], -x[1]))
    heapq.heapify(ctx.heap)
    return n


def _one(k: int):
    fn, items = _FORKED
    return fn(items[k])


def map_ordered(fn, items: list) -> list:
    """[fn(x) for x in items], dealt to forked workers on the same terms as the search (`_workers`): the
    ranked layouts' full estimates, whose pipeline simulations would otherwise run on one core after
    the search has used them all."""
    global _FORKED
    n = _workers(len(items))
    if n == 1:
        return [fn(x) for x in items]
    _FORKED = (fn, items)
    try:
        with mp.get_context("fork").Pool(n) as pool:
            return pool.map(_one, range(len(items)), chunksize=1)
    finally:
        _FORKED = None
