"""Expert parallelism on CPU: all-to-all bytes per step against the formula, and step time for ep 1/2/4.

    .venv/bin/python bench/moe.py [--world 4] [--ep 1 2 4] [--steps 4] [--dim 128] [--seq-len 128] ...

Every row trains the same MoE model on `world` gloo ranks (dp = world, so the global batch and the
routing are the same; only where the experts live changes), reads the bytes the `ep` group's `Comm`
booked, averaged over the ranks (the bytes a rank sends, its own block included: the dispatch sends
its T·k assignments, the return sends back what it received, which depends on the routing, so only
the mean over the ep group is fixed), and prints them next to

    formula = MoE blocks × micro-batches × (4 · T·k·d·bytes + E·8)

(dropless: each of the T·k assignments of a micro-batch goes out and comes back in forward, and both
again in backward; E int64 split sizes go first in forward) and next to the planner's all-to-all bytes
for the same layout (plan/cost/comm.py, which leaves the split sizes out). Output is a markdown table for
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from spawn import spawn  # noqa: E402  (bench/spawn.py)
from tp import start_trainer  # noqa: E402


def _worker(rank: int, world: int, port: int, overrides: dict, steps: int, out) -> None:
    from meshlm.distributed.mesh import shutdown

    try:
        _, _, ctx, trainer, step_s = start_trainer(rank, world, port, overrides, steps)
        a2a = ctx.comms["ep"].stats["all_to_all"] if "ep" in ctx.comms else None
        mine = [a2a.bytes / steps, a2a.calls / steps, a2a.seconds / steps] if a2a else [0.0, 0.0, 0.0]
        # a rank sends back what it received, which depends on the routing: the formula is the mean
        mean = [v / world for v in ctx.comm("world").all_reduce_scalars(mine)]
        if rank == 0:
            out.put({"step_s": step_s, "a2a_bytes": mean[0], "a2a_calls": mean[1], "a2a_s": mean[2],
                     "a2a_bytes_rank0": mine[0]})
    finally:
        shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-dim", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    a = ap.parse_args()
    from meshlm.core import config as C
    from meshlm.plan.cost.comm import collectives
    from meshlm.plan.spec import priced_on, shape_from_config, spec_from_config

    base = {"model.preset": "moe-debug", "model.dim": a.dim, "model.n_layers": a.layers,
            "model.moe.num_experts": a.experts, "model.moe.top_k": a.top_k, "model.moe.ffn_dim": a.expert_dim,
            "data.seq_len": a.seq_len, "training.micro_batch": a.micro_batch,
            "training.global_batch": a.micro_batch * a.accum * a.world, "training.eval_every": 0,
            "training.steps": 100, "metrics.progress": False, "checkpoint.resume": "never",
            "parallel.dp": a.world}
    T, d = a.micro_batch * a.seq_len, a.dim
    print(f"MoE {a.layers} blocks, dim {d}, {a.experts} experts of {a.expert_dim} (top-{a.top_k}, 1 shared), "
          f"seq {a.seq_len}, micro-batch {a.micro_batch} × {a.accum} per rank, {a.world} gloo ranks (dp {a.world}), "
          f"fp32, dropless\n")
    print("| ep | all-to-all bytes/step (mean over ranks) | formula | planner | rank 0 | calls/step | all-to-all s/step | step s | ratio to ep 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    first = None
    for ep in a.ep:
        over = dict(base, **{"parallel.ep": ep})
        r = spawn(_worker, a.world, over, a.steps, timeout=1800)
        formula = a.layers * a.accum * (4 * T * a.top_k * d * 4 + a.experts * 8) if ep > 1 else 0
        cfg = C.Config()
        for k, v in over.items():
            C.apply(cfg, k, v)
        cfg = priced_on(cfg, gpu=False)  # the workers above trained on this CPU
        planned = sum(c.calls * c.buffer_bytes for c in collectives(shape_from_config(cfg), spec_from_config(cfg, a.world),
                                                                0, 0, a.layers, True, True, None) if c.group == "ep")
        first = first or r["step_s"]
        print(f"| {ep} | {r['a2a_bytes']:,.0f} | {formula:,.0f} | {planned:,.0f} | {r['a2a_bytes_rank0']:,.0f} | "
              f"{r['a2a_calls']:.0f} | "
              f"{r['a2a_s']:.3f} | {r['step_s']:.3f} | {r['step_s'] / first:.2f} |", flush=True)


if __name__ == "__main__":
    main()
