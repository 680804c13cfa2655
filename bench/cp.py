"""Context parallelism at a fixed total sequence: activation memory per rank, step time, bytes.

    .venv/bin/python bench/cp.py [--preset small] [--seq-len 4096] [--cp 1 2 4] [--steps 2] ...

For cp = 1, 2, 4 and each of ring / Ulysses this trains a few steps on gloo workers (one sequence of
`--seq-len` tokens per step, split over the CP group) and prints, for rank 0:
- activation bytes: what autograd saves for backward in one micro-batch's forward + loss (distinct
  storages, no parameters; `train.saved.saved_bytes`), in total and for one block (the
  attention + block activations that CP divides), next to the planner's prediction;
- peak RSS of the worker (CPU: includes the model, optimizer, allocator slack);
- step time (CPU, 2 shared cores: relative only);
- bytes per step the cp group's `Comm` booked next to `plan/cost/volume.py` (`cp_step_bytes`).
Output is markdown (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from spawn import spawn  # noqa: E402  (bench/spawn.py)


def _config(overrides: dict):
    from meshlm.core import config as C
    cfg = C.Config()
    for k, v in overrides.items():
        C.apply(cfg, k, v)
    return cfg


def _worker(rank: int, world: int, port: int, overrides: dict, steps: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    from meshlm.distributed.comm import reset_stats
    from meshlm.distributed.mesh import init_context, pick_device, shutdown
    from meshlm.core.layout import build_layout
    from meshlm.train.observe.saved import saved_bytes
    from meshlm.train.trainer import Trainer

    torch.set_num_threads(max(1, 2 // world))
    cfg = _config(overrides)
    layout = build_layout(cfg, world)
    ctx = init_context(layout.shape(), pick_device("cpu"), timeout_s=600)
    try:
        trainer = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-bench-cp-"), ctx, layout)
        trainer.train_step()  # warm-up, not counted
        reset_stats(ctx.all_comms())
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(measure=False)
        step_s = (time.perf_counter() - t0) / steps
        stats = {k: (s.calls / steps, s.bytes / steps) for k, s in ctx.comm("cp").stats.items() if k != "recv_wait"}
        par = trainer.par
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (layout.micro_batch, cfg.data.seq_len + 1), generator=g)
        x, y = (par.local_tokens(t) for t in (tokens[:, :-1], tokens[:, 1:]))
        total = saved_bytes(lambda: par.loss_fn(par.model(x), y), skip=par.model.parameters()).total
        block = par.model.layers["0"]
        h = par.model.tok_embeddings(x).detach()
        pos = par.cp.split.positions(x.shape[1]) if par.cp is not None else torch.arange(x.shape[1])
        cos, sin = par.model.rope(cfg.data.seq_len, x.device)
        blk = saved_bytes(lambda: block(h, cos[pos], sin[pos]), skip=block.parameters()).total
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if rank == 0:
            out.put({"stats": stats, "total": total, "block": blk, "rss": rss, "step_s": step_s})
    finally:
        shutdown()


def measure(overrides: dict, world: int, steps: int) -> dict:
    return spawn(_worker, world, overrides, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--impl", nargs="+", default=["ring", "ulysses", "allgather"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--ac", default="none")
    ap.add_argument("--attn-impl", default="flex", choices=("flex", "sdpa"),
                    help="model.attn_impl of the all-gather rows (auto is sdpa on a CPU, flex on CUDA)")
    a = ap.parse_args()

    from meshlm.core.config.model import model_args
    from meshlm.plan.cost.estimate import Options, estimate
    from meshlm.plan.spec import code_options, priced_on, shape_from_config, spec_from_config
    from meshlm.plan.cost.volume import cp_step_bytes as expected_bytes

    base = {"model.preset": a.preset, "model.max_seq_len": a.seq_len, "data.seq_len": a.seq_len,
            "training.micro_batch": 1, "training.global_batch": 1, "training.precision": a.precision,
            "training.ac": a.ac, "training.eval_every": 0, "training.steps": a.steps + 1,
            "metrics.progress": False, "checkpoint.resume": "never"}
    args = model_args(_config(base))
    e = 4 if a.precision == "fp32" else 2
    print(f"model {a.preset}: dim {args.dim}, layers {args.n_layers}, heads {args.n_heads}/{args.n_kv_heads} kv; "
          f"one sequence of {a.seq_len} tokens per step, {a.precision}, ac {a.ac}; rank 0\n")
    print("| layout | saved acts (MB) | ratio to cp1 | planner (MB) | block 0 (MB) | ratio | peak RSS (MB) "
          "| step (s) | cp MB/step measured | formula | match |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    first = None
    for c in a.cp:
        for impl in (a.impl if c > 1 else ["-"]):
            ov = dict(base, **{"parallel.cp": c, "parallel.cp_impl": impl if c > 1 else "ring"},
                      **({"model.attn_impl": a.attn_impl} if impl == "allgather" else {}))
            cfg = _config(ov)
            r = measure(ov, c, a.steps)
            want = expected_bytes(args, 1, a.seq_len, 1, c, impl, 1, a.ac, e)
            got_b = sum(v[1] for k, v in r["stats"].items() if k != "recv")
            want_b = sum(v[1] for k, v in want.items() if k != "recv")
            ok = "yes" if {k: v for k, v in r["stats"].items()} == {k: tuple(map(float, v)) for k, v in want.items()} else "NO"
            code = code_options(priced_on(cfg, gpu=False))
            o = Options(attn_mask=code["attn_mask"], attn_impl=code["attn_impl"])  # all-gather: flex or a dense mask
            pred = estimate(shape_from_config(cfg), spec_from_config(cfg, c), o=o)["per_gpu"]["activations"]
            first = first or r
            name = "cp1" if c == 1 else f"cp{c} {impl}"
            print(f"| {name} | {r['total'] / 1e6:.1f} | {first['total'] / r['total']:.2f}× | {pred / 1e6:.1f} "
                  f"| {r['block'] / 1e6:.2f} | {first['block'] / r['block']:.2f}× | {r['rss'] / 1e6:.0f} "
                  f"| {r['step_s']:.2f} | {got_b / 1e6:.2f} | {want_b / 1e6:.2f} | {ok if c > 1 else '-'} |")


if __name__ == "__main__":
    main()
