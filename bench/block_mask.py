"""Building a FlexAttention BlockMask: torch's create_block_mask (the mask function evaluated at every
query-key pair) against meshlm's build from block bounds (model.flex.flex_block_mask), side by side in
one run, with the blocks each keeps (they must agree).

    python bench/block_mask.py [--device cpu|cuda] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from meshlm.model.flex import flex_block_mask  # noqa: E402
from meshlm.parallel.dims.context_parallel import CPSplit  # noqa: E402

# (batch, sequence, cp, document length): one process with documents, then all-gather CP rows
CASES = ((4, 2048, 1, 700), (4, 8192, 1, 700), (1, 32768, 4, 4096), (1, 65536, 8, 4096))


def timed(fn, device, reps: int):
    out, times = None, []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    from torch.nn.attention.flex_attention import create_block_mask
    dev = torch.device(a.device)
    rows_out = []
    print("| batch | seq | cp | doc | create_block_mask ms | bounds ms | speed-up | kept blocks equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for b, s, cp, doc in CASES:
        docs = (torch.arange(s, device=dev) // doc)[None].expand(b, s).contiguous()
        rows = CPSplit(cp, 1, True).positions(s // cp, dev) if cp > 1 else torch.arange(s, device=dev)

        def mod(bb, h, q, k):
            return (rows[q] >= k) & (docs[bb, rows[q]] == docs[bb, k])
        ref, t_ref = timed(lambda: create_block_mask(mod, b, None, s // cp, s, device=dev), dev, a.reps)
        mine, t_mine = timed(lambda: flex_block_mask(docs, s // cp, dev, rows if cp > 1 else None, s), dev, a.reps)
        same = all(torch.equal(getattr(ref, k), getattr(mine, k)) for k in ("kv_num_blocks", "full_kv_num_blocks"))
        rows_out.append(dict(batch=b, seq=s, cp=cp, doc=doc, ref_ms=t_ref * 1e3, ms=t_mine * 1e3, same=same))
        print(f"| {b} | {s} | {cp} | {doc} | {t_ref * 1e3:.1f} | {t_mine * 1e3:.2f} | {t_ref / t_mine:.0f}× | "
              f"{'yes' if same else 'NO'} |")
    return rows_out


if __name__ == "__main__":
    main()
