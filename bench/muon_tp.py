"""Newton-Schulz FLOPs and bytes per rank of one Muon step under tensor parallelism.

    PYTHONPATH=src .venv/bin/python bench/muon_tp.py [--preset debug] [--tp 2] [--dp 1] [--zero 0]

Trains one warm-up step on gloo workers, then wraps `newton_schulz` (the module attribute that
parallel/optim/muon.py calls) to record the shape of every call, and Muon's step to read what every `Comm`
of the rank booked during it. Prints per rank: NS calls, NS FLOPs (counted from the recorded shapes:
per quintic iteration 4·m²·n + 2·m³ for an m×n matrix, m ≤ n), and the bytes booked per collective
kind, the tp exchange's buckets and the largest one's send + receive buffers (without ZeRO;
parallel.bucket_mb caps them: `--bucket-mb`), then the busiest rank's FLOPs next to the sum over the
ranks (their ratio is the spread).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from spawn import spawn_gloo  # noqa: E402  (bench/spawn.py)
from tp import start_trainer  # noqa: E402  (bench/tp.py)


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    m, n = sorted(shape[-2:])
    return steps * math.prod(shape[:-2]) * (4 * m * m * n + 2 * m ** 3)


def _worker(rank: int, world: int, port: int, overrides: dict, out) -> None:
    from meshlm.distributed.comm import merge_stats
    from meshlm.distributed.mesh import shutdown
    from meshlm.parallel.optim import muon as M

    try:
        cfg, _, ctx, trainer, _ = start_trainer(rank, world, port, overrides, 1)
        calls, books = [], {}
        inner_ns, opt = M.newton_schulz, trainer.par.optimizer.muon
        inner_step = opt.step

        def counting_ns(g, steps, *a, **kw):
            calls.append(ns_flops(tuple(g.shape), steps))
            return inner_ns(g, steps, *a, **kw)

        def step(lr, c):
            comms = ctx.all_comms()
            before = {k: s.bytes for k, s in merge_stats(comms).items()}
            inner_step(lr, c)
            books.update({k: s.bytes - before.get(k, 0) for k, s in merge_stats(comms).items()
                          if s.bytes != before.get(k, 0)})
        M.newton_schulz, opt.step = counting_ns, step
        trainer.train_step()
        x = getattr(opt, "exchange", None)  # LocalMuon's tp exchange
        buckets = (len(x.buckets), x.buffer_bytes()) if x is not None else (0, 0)
        out.put((rank, (len(calls), sum(calls), books, buckets)))
    finally:
        shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    a = ap.parse_args()
    world = a.tp * a.dp
    ov = {"model.preset": a.preset, "optim.name": "muon", "parallel.tp": a.tp, "parallel.dp": a.dp,
          "parallel.zero": a.zero, "parallel.bucket_mb": a.bucket_mb, "data.seq_len": 32, "training.micro_batch": 1, "training.global_batch": a.dp,
          "training.eval_every": 0, "training.steps": 4, "metrics.progress": False, "checkpoint.resume": "never"}
    got = [(r, *v) for r, v in sorted(spawn_gloo(_worker, world, ov, timeout=900).items())]
    print(f"{a.preset}: tp {a.tp}, dp {a.dp}, zero {a.zero}, bucket_mb {a.bucket_mb}; one Muon step")
    print("| rank | NS calls | NS MFLOP | bytes booked in Muon's step | tp buckets | largest bucket's buffers, bytes |")
    print("|---:|---:|---:|---|---:|---:|")
    for rank, n, flops, books, (nb, peak) in got:
        print(f"| {rank} | {n} | {flops / 1e6:.2f} | {', '.join(f'{k} {v:,}' for k, v in sorted(books.items()))} "
              f"| {nb} | {peak:,} |")
    flops = [f for _, _, f, *_ in got]
    print(f"\nbusiest rank {max(flops) / 1e6:.2f} MFLOP, all ranks {sum(flops) / 1e6:.2f} MFLOP, "
          f"busiest x world / all = {max(flops) * world / sum(flops):.3f}")


if __name__ == "__main__":
    main()
