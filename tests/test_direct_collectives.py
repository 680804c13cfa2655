"""gloo's collectives as one all-to-all hop (distributed/direct.py) against gloo's own rings, on the same
tensors in the same pool: what each guarantees is checked as tightly as the math allows."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshlm.distributed import direct
from meshlm.distributed.comm import Comm

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}
# (numel, dtype): one element, a size no group divides, and one above ONE_HOP_BYTES (the two-phase path)
CASES = [(1, torch.float32), (7, torch.float32), (4097, torch.bfloat16), (40_000, torch.float32),
         (23, torch.int64)]


def _values(rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.int64:
        return torch.randint(-50, 50, (numel,), generator=g)
    x = torch.randn(numel, generator=g)
    if op == "product":  # keep products of four away from overflow and zero
        x = 1 + 0.1 * x
    return x.to(dtype)


def _compare(ranks: list[int] | None):
    """On every pool rank: each collective both ways (direct, then gloo's ring) on one group; returns
    {ring: {case: values}} as lists, with "|mag" beside each case: the float64 sum of the operands'
    magnitudes (what bounds a sum's rounding)."""
    import os
    group = dist.new_group(ranks) if ranks else dist.group.WORLD
    me = dist.get_rank()
    members = ranks or list(range(dist.get_world_size()))
    if me not in members:
        return None
    comm = Comm("t", group, members, me)
    out = {}
    for ring in ("0", "1"):
        os.environ["MESHLM_GLOO_RING"] = ring
        got = {}
        for name, op in OPS.items():
            for numel, dtype in CASES:
                if dtype == torch.int64 and name == "product":
                    continue
                t = _values(me, numel, dtype, name)
                mag = t.double().abs()
                dist.all_reduce(mag, group=group)
                comm.all_reduce(t, op=op)
                got[f"ar-{name}-{dtype}-{numel}"], got[f"ar-{name}-{dtype}-{numel}|mag"] = t.float().tolist(), mag.tolist()
        for numel, dtype in CASES:
            shard = _values(me, numel, dtype, "sum")
            gathered = torch.empty(comm.size * numel, dtype=dtype)
            comm.all_gather(gathered, shard, async_op=True).wait()
            got[f"ag-{dtype}-{numel}"] = gathered.float().tolist()
            full = _values(me, numel * comm.size, dtype, "sum")
            mine = torch.empty(numel, dtype=dtype)
            comm.reduce_scatter(mine, full, async_op=True).wait()
            mag = full.double().abs()
            dist.all_reduce(mag, group=group)
            got[f"rs-sum-{dtype}-{numel}"] = mine.float().tolist()
            got[f"rs-sum-{dtype}-{numel}|mag"] = mag[comm.rank * numel:(comm.rank + 1) * numel].tolist()
        out[ring] = got
    os.environ.pop("MESHLM_GLOO_RING")
    return out


@pytest.mark.parametrize("world, ranks", [(2, None), (4, None), (4, [1, 3])], ids=["2", "4", "4-sub13"])
def test_direct_matches_gloos_rings(pools, world, ranks):
    results = [r for r in pools(world).run(_compare, ranks) if r is not None]
    size = len(ranks or range(world))
    assert len(results) == size
    for key in (k for k in results[0]["0"] if not k.endswith("|mag")):
        direct_all = [r["0"][key] for r in results]
        if key.startswith(("ar-", "ag-")):
            # every rank folds in rank order: the same bits on every member (an all-gather moves them)
            assert all(d == direct_all[0] for d in direct_all), key
        d = torch.tensor(direct_all[0], dtype=torch.float64)
        r = torch.tensor(results[0]["1"][key], dtype=torch.float64)
        if key.startswith("ag-") or "int64" in key or "-max-" in key or "-min-" in key or size == 2:
            # moved, not rounded; integers; max/min; or two operands, whose sum and product commute
            assert torch.equal(d, r), key
            continue
        # more operands reduced in another order: each order's error is at most (n-1) half-ulps of
        # the operands' magnitudes (sum) or of the product; two orders differ by at most twice that
        eps = torch.finfo(torch.bfloat16 if "bfloat16" in key else torch.float32).eps
        scale = r.abs() if "-product-" in key else torch.tensor(results[0]["1"][key + "|mag"])
        assert ((d - r).abs() <= (size - 1) * eps * scale + 1e-30).all(), key


def _async_and_band_stay_native():
    """On every pool rank, the direct path on: an async all-reduce and a BAND all-reduce with
    direct.all_reduce made to fail, so they pass only through gloo's own collective."""
    import os
    os.environ.pop("MESHLM_GLOO_RING", None)
    comm = Comm("t", dist.group.WORLD, list(range(dist.get_world_size())), dist.get_rank())
    saved = direct.all_reduce

    def refuse(*_a, **_k):
        raise AssertionError("took the direct all-reduce")
    direct.all_reduce = refuse
    try:
        t = torch.full((5,), float(dist.get_rank() + 1))
        comm.all_reduce(t, async_op=True).wait()
        flags = torch.tensor([0b110 | dist.get_rank()], dtype=torch.int64)
        comm.all_reduce(flags, op=dist.ReduceOp.BAND)
    finally:
        direct.all_reduce = saved
    return t.tolist(), flags.item()


def test_async_all_reduce_and_other_ops_keep_gloos_collective(pools, monkeypatch):
    """What the direct path does not take: async all-reduces (a second hop started at a handle's wait
    could start in another order on another rank), ops it cannot fold, and MESHLM_GLOO_RING=1."""
    for t, flags in pools(2).run(_async_and_band_stay_native):
        assert t == [3.0] * 5 and flags == 0b110
    monkeypatch.delenv("MESHLM_GLOO_RING", raising=False)
    assert direct.enabled() and direct.supports(dist.ReduceOp.SUM)
    assert not direct.supports(dist.ReduceOp.BAND)
    monkeypatch.setenv("MESHLM_GLOO_RING", "1")
    assert not direct.enabled()


def test_fold_rounds_in_the_dtype_in_rank_order():
    chunks = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8]], dtype=torch.bfloat16)
    out = torch.empty(1, dtype=torch.bfloat16)
    direct.fold(chunks, dist.ReduceOp.SUM, out)
    # 1 + 2^-8 rounds back to 1 in bf16 (8 bits of mantissa), twice: a ring's per-hop rounding, not
    # a float32 accumulation (which would give 1 + 2^-7)
    assert out.item() == 1.0
