"""gloo's rings against distributed/direct.py's one-hop collectives, the hop over gloo's all-to-all and
over the ranks' own sockets (distributed/sockets.py), side by side in one run on the same ranks
(docs/architecture.md, "Collectives on gloo"): milliseconds per call and the ring's time over the
sockets', per world size, collective and size. The ranks share the host's cores, as the test suite's
pools do.

    python bench/gloo_collectives.py                     # 2 and 4 ranks, 512 B and 16 KiB per rank
    python bench/gloo_collectives.py --worlds 2 --calls 20   # plumbing (tests/test_bench.py)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spawn  # noqa: E402

SIZES = (128, 4096)  # float32 elements per rank's slice: 512 B and 16 KiB


def _time(fn, calls: int) -> float:
    """Mean milliseconds of `fn()`, after a warm-up, started together on every rank."""
    import torch.distributed as dist
    for _ in range(5):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def worker(rank: int, world: int, port: int, calls: int, q) -> None:
    spawn.join_gloo(rank, world, port)
    import torch
    import torch.distributed as dist

    from meshlm.distributed.comm import Comm
    modes = {"ring": ("1", "1"), "a2a": ("0", "0"), "sockets": ("0", "1")}  # MESHLM_GLOO_RING, _SOCKETS
    rows = []
    for n in SIZES:
        t, full, out = torch.ones(n), torch.ones(n * world), torch.empty(n)
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            ms = {}
            for mode, (ring, socks) in modes.items():  # one after the other, same ranks
                os.environ.update(MESHLM_GLOO_RING=ring, MESHLM_GLOO_SOCKETS=socks)
                comm = Comm("bench", dist.group.WORLD, list(range(world)), rank)  # its sockets: at first use
                call = {"all_reduce": (comm.all_reduce, t), "all_gather": (comm.all_gather, full, t),
                        "reduce_scatter": (comm.reduce_scatter, out, full)}[name]
                ms[mode] = _time(functools.partial(*call), calls)
                comm.release()
            rows.append({"world": world, "collective": name, "bytes_per_rank": 4 * n,
                         **{f"{m}_ms": round(v, 4) for m, v in ms.items()},
                         "speedup": round(ms["ring"] / ms["sockets"], 2)})
    q.put(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    rows = [r for world in args.worlds for r in spawn.spawn(worker, world, args.calls)]
    for r in rows:
        print(f"world {r['world']} {r['collective']:15s} {r['bytes_per_rank']:6d} B: ring {r['ring_ms']:.3f} ms, "
              f"all-to-all {r['a2a_ms']:.3f} ms, sockets {r['sockets_ms']:.3f} ms ({r['speedup']}x)", file=sys.stderr)
    print(json.dumps({"bench": "gloo_collectives", "rows": rows}))


if __name__ == "__main__":
    main()
