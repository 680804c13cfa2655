"""Bytes moved per step by tensor-parallel collectives, measured vs the count for the model shape.

    .venv/bin/python bench/tp.py [--preset small] [--tp 2 4] [--seq-len 128] [--micro-batch 2] ...

For each TP degree, with and without sequence parallelism, this trains a few steps on gloo workers,
reads the bytes the tp group's `Comm` booked (logical payload per rank: all-reduce 2× its buffer,
all-gather its output, reduce-scatter its input) and prints them next to
`plan/cost/volume.py` (`tp_step_bytes`) for the same shape. It also prints the saved-activation bytes of one
block by part, to show what SP buys. Output is a markdown table (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from spawn import spawn  # noqa: E402  (bench/spawn.py)


def start_trainer(rank: int, world: int, port: int, overrides: dict, steps: int):
    """In a spawned worker: join the gloo job, build the Trainer, run one warm-up step and `steps`
    counted ones (comm stats reset between). Returns (cfg, layout, ctx, trainer, seconds per step);
    the caller calls mesh.shutdown(). Shared with bench/moe.py."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import time

    import torch

    from meshlm.core import config as C
    from meshlm.distributed.comm import reset_stats
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = C.Config()
    for k, v in overrides.items():
        C.apply(cfg, k, v)
    layout = build_layout(cfg, world)
    ctx = init_context(layout.shape(), pick_device("cpu"), timeout_s=300)
    trainer = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-bench-"), ctx, layout)
    trainer.train_step()  # warm-up, not counted
    reset_stats(ctx.all_comms())
    ctx.comm("world").barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    ctx.comm("world").barrier()
    return cfg, layout, ctx, trainer, (time.perf_counter() - t0) / steps


def _worker(rank: int, world: int, port: int, overrides: dict, steps: int, out) -> None:
    import torch

    from meshlm.distributed.mesh import shutdown
    from meshlm.parallel.model_plans.moe import model_plan_for
    from meshlm.train.observe.saved import block_saved_bytes

    try:
        cfg, layout, ctx, trainer, _ = start_trainer(rank, world, port, overrides, steps)
        stats = {k: (s.calls / steps, s.bytes / steps, s.seconds / steps) for k, s in ctx.comm("tp").stats.items()}
        tokens = torch.randint(0, cfg.model.vocab_size or 256, (layout.micro_batch, cfg.data.seq_len))
        acts = block_saved_bytes(trainer.model.layers["0"], lambda: trainer.model(tokens),
                                 model_plan_for(trainer.model))
        if rank == 0:
            out.put((stats, acts))
    finally:
        shutdown()


def measure(overrides: dict, world: int, steps: int) -> tuple[dict, dict]:
    return spawn(_worker, world, overrides, steps, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--ac", default="none")
    a = ap.parse_args()

    from meshlm.core import config as C
    from meshlm.core.layout import build_layout
    from meshlm.core.config.model import model_args
    from meshlm.plan.cost.volume import tp_step_bytes as expected_bytes

    base = {"model.preset": a.preset, "data.seq_len": a.seq_len, "training.micro_batch": a.micro_batch,
            "training.global_batch": a.global_batch, "training.precision": a.precision, "training.ac": a.ac,
            "training.eval_every": 0, "training.steps": a.steps + 1, "metrics.progress": False,
            "checkpoint.resume": "never"}
    cfg = C.Config()
    for k, v in base.items():
        C.apply(cfg, k, v)
    args = model_args(cfg)
    e = 4 if a.precision == "fp32" else 2
    print(f"model {a.preset}: dim {args.dim}, layers {args.n_layers}, heads {args.n_heads}/{args.n_kv_heads} kv, "
          f"ffn {args.ffn_dim}, vocab {args.vocab_size}; micro-batch {a.micro_batch} × seq {a.seq_len}, "
          f"global batch {a.global_batch}, {a.precision}, ac {a.ac}\n")
    print("| layout | collective | calls/step | MB/step measured | MB/step theory | match |")
    print("|---|---|---:|---:|---:|---|")
    act_rows = []
    for t in a.tp:
        for sp in (False, True):
            ov = dict(base, **{"parallel.tp": t, "parallel.sp": sp})
            c2 = C.Config()
            for k, v in ov.items():
                C.apply(c2, k, v)
            layout = build_layout(c2, t)
            want = expected_bytes(args, layout.micro_batch, a.seq_len, layout.accum, t, sp, a.ac, e, e)
            got, acts = measure(ov, t, a.steps)
            name = f"tp{t}{'+sp' if sp else ''}"
            for kind in sorted(set(want) | set(got)):
                gc, gb, _ = got.get(kind, (0, 0, 0))
                wc, wb = want.get(kind, (0, 0))
                ok = "yes" if (gc, gb) == (wc, wb) else "NO"
                print(f"| {name} | {kind} | {gc:g} | {gb / 1e6:.3f} | {wb / 1e6:.3f} | {ok} |")
            total_g = sum(v[1] for v in got.values())
            total_w = sum(v[1] for v in want.values())
            print(f"| {name} | **total** | | **{total_g / 1e6:.3f}** | **{total_w / 1e6:.3f}** | |")
            act_rows.append((name, acts))
    print("\nSaved activations of one block (forward, bytes per rank):\n")
    print("| layout | norm / residual | attention | feed-forward | block total |")
    print("|---|---:|---:|---:|---:|")
    for name, acts in act_rows:
        total = sum(acts.values())
        print(f"| {name} | {acts['norm']:,} | {acts['attention']:,} | {acts['feed_forward']:,} | {total:,} |")


if __name__ == "__main__":
    main()
