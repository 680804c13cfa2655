"""Framework overhead on one process: meshlm's trainer vs a bare hand-written PyTorch loop.

Both train the same model (meshlm's Llama, same init) on the same batches with the same AdamW and LR
schedule; the bare loop is what anyone would write (forward, loss, backward, step, loss.item()). Runs
alternate A/B several times so machine noise hits both alike; the ratio is of median step times.

    python bench/overhead.py [--json] [--preset small] [--steps 12] [--rounds 5]
ratio = bare step time / meshlm step time (higher is better; goal >= 0.97).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from meshlm.core import config as C
from meshlm.data import GlobalBatchSampler, TokenShards, default_data_dir
from meshlm.distributed.mesh import init_context, pick_device
from meshlm.core.layout import build_layout
from meshlm.core.config.model import model_args
from meshlm.model import Llama, materialize
from meshlm.core.facts.course import lr_at
from meshlm.train.trainer import Trainer


def make_cfg(a) -> C.Config:
    cfg = C.Config()
    for k, v in {"model.preset": a.preset, "data.seq_len": a.seq_len, "training.global_batch": a.batch,
                 "training.micro_batch": a.batch, "training.steps": a.steps, "training.eval_every": 0,
                 "metrics.progress": False, "checkpoint.resume": "never", "training.device": "cpu"}.items():
        C.apply(cfg, k, v)
    return cfg


def bare_loop(cfg: C.Config, steps: int) -> list[float]:
    """The reference: plain PyTorch, no hooks, no buckets, no metrics."""
    args = model_args(cfg)
    with torch.device("meta"):
        model = Llama(args)
    materialize(model, cfg.training.seed, "cpu")
    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    data = TokenShards(default_data_dir(), "train")
    sampler = GlobalBatchSampler.for_shards(data, cfg.data.seq_len, cfg.training.global_batch, cfg.training.seed)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y, _ = sampler.next_batch(data)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o, steps)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.clip, foreach=True)
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def meshlm_loop(cfg: C.Config, steps: int) -> list[float]:
    """meshlm's trainer through fit(), logging every step: per-step wall times from metrics.jsonl."""
    run_dir = tempfile.mkdtemp(prefix="meshlm-overhead-")
    layout = build_layout(cfg, 1)
    trainer = Trainer(cfg, run_dir, init_context(layout.shape(), pick_device("cpu")), layout)
    trainer.fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step_s"] for line in f if '"step_s"' in line][:steps]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cfg = make_cfg(a)
    default_data_dir()  # prepare the corpus outside the timed runs
    bare, ours = [], []
    for r in range(a.rounds):
        runs = [("bare", bare_loop), ("meshlm", meshlm_loop)]
        if r % 2:
            runs.reverse()
        for name, fn in runs:
            (bare if name == "bare" else ours).extend(fn(cfg, a.steps)[a.skip:])
    mb, mm = statistics.median(bare), statistics.median(ours)
    result = {"ratio": mb / mm, "bare_median_s": mb, "meshlm_median_s": mm, "preset": a.preset,
              "seq_len": a.seq_len, "batch": a.batch, "steps_per_run": a.steps, "rounds": a.rounds,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"bare loop median step {mb * 1e3:.1f} ms, meshlm {mm * 1e3:.1f} ms, "
              f"ratio bare/meshlm = {mb / mm:.3f} (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
