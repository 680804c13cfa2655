"""Benchmark (not a test): sharded checkpoint cost on dp ranks (gloo, CPU), ZeRO-3 by default.

Three variants in fresh worker processes, same model and batches: no checkpoints, a synchronous
checkpoint every step, an async one every step. Reports the median step time (slowest rank), the time a
save blocks the step (`ckpt.save_s`), the write time (`write_s`, in the background when async), the bytes
written by all ranks, and the rise of rank 0's peak resident memory over the no-checkpoint run, as a
fraction of the full state (12 B/param: fp32 master + two Adam moments).

    python bench/ckpt.py [--dim 512 --n-layers 8 --ffn-dim 2048] [--world 4] [--zero 3] [--steps 4] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from spawn import join_gloo, spawn_gloo  # noqa: E402  (bench/spawn.py)
from zero import _hwm, _rss

VARIANTS = ("none", "sync", "async")


def make_cfg(a, variant: str):
    from meshlm.core import config as C
    cfg = C.Config()
    for k, v in {"model.preset": "small", "model.dim": a.dim, "model.n_layers": a.n_layers, "model.n_heads": 8,
                 "model.n_kv_heads": 8, "model.ffn_dim": a.ffn_dim, "data.seq_len": a.seq_len,
                 "training.global_batch": a.world, "training.micro_batch": 1, "training.steps": a.steps + 1,
                 "training.eval_every": 0, "metrics.progress": False, "checkpoint.resume": "never",
                 "training.device": "cpu", "parallel.dp": a.world, "parallel.zero": a.zero,
                 "checkpoint.every": 0 if variant == "none" else 1, "checkpoint.keep": 1,
                 "checkpoint.async": variant == "async"}.items():
        C.apply(cfg, k, v)
    return cfg


def worker(rank: int, world: int, port: int, variant: str, a, out) -> None:
    join_gloo(rank, world, port)
    import torch.distributed as dist

    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.train.trainer import Trainer

    base = _rss()
    cfg = make_cfg(a, variant)
    layout = build_layout(cfg, world)
    run_dir = os.path.join(a.out, variant)
    tr = Trainer(cfg, run_dir, init_context(layout.shape(), pick_device("cpu")), layout)
    tr.fit()  # step 1 warms up; every line after it is a measured step
    peak = _hwm() - base
    dist.barrier()
    out.put((rank, peak))
    dist.destroy_process_group()


def run_variant(variant: str, a) -> dict:
    peaks = spawn_gloo(worker, a.world, variant, a)
    lines = [json.loads(x) for x in open(os.path.join(a.out, variant, "metrics.jsonl"))]
    steps = [x for x in lines if "loss" in x and x["step"] > 1]
    saves = [x["ckpt"] for x in lines if "ckpt" in x and x["step"] > 1]
    writes = [c for c in saves if "write_s" in c]
    med = (lambda xs: statistics.median(xs) if xs else 0.0)  # noqa: E731
    return {"step_s": med([x["step_s"] for x in steps]), "save_s": med([c["save_s"] for c in saves if "save_s" in c]),
            "write_s": med([c["write_s"] for c in writes]), "bytes": med([c["bytes"] for c in writes]),
            "peak_rank0": peaks[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--ffn-dim", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
    a.out = tempfile.mkdtemp(prefix="meshlm-ckpt-bench-")
    try:
        res = {v: run_variant(v, a) for v in VARIANTS}
    finally:
        shutil.rmtree(a.out, ignore_errors=True)
    from meshlm.core.config.model import model_args
    n = model_args(make_cfg(a, "none")).num_params()
    for v in VARIANTS:
        res[v]["peak_growth_x_state"] = (res[v]["peak_rank0"] - res["none"]["peak_rank0"]) / (12 * n)
    report = {"params": n, "world": a.world, "zero": a.zero, "results": res}
    if a.json:
        print(json.dumps(report))
        return
    print(f"{n / 1e6:.1f}M params, dp{a.world} zero{a.zero} gloo, {a.steps} measured steps, checkpoint every step "
          f"(full state {12 * n / 2**20:.0f} MiB)")
    print(f"{'variant':<7} {'step s':>7} {'save_s':>7} {'write_s':>8} {'MiB written':>11} {'rank0 peak MiB':>14} "
          f"{'growth x state':>14}")
    for v in VARIANTS:
        r = res[v]
        print(f"{v:<7} {r['step_s']:7.2f} {r['save_s']:7.2f} {r['write_s']:8.2f} {r['bytes'] / 2**20:11.1f} "
              f"{r['peak_rank0'] / 2**20:14.1f} {r['peak_growth_x_state']:14.3f}")


if __name__ == "__main__":
    sys.exit(main())
