"""Muon against AdamW on the embedded corpus (CPU, one process): steps and wall time to the held-out loss
AdamW reaches at its last step.

    .venv/bin/python bench/optim_muon.py [--models tiny small 50m] [--steps 200] [--lrs 1e-3 3e-3 1e-2]
                                         [--eval-every 10] [--png docs/img/optim_muon.png] [--json]

Per model, both optimizers train `steps` steps at each learning rate (`optim.lr`; Muon's rate is the
same, `optim.muon_lr = 0`: Moonlight's RMS matching makes one rate serve both), the same data order,
seed, warm-up and cosine schedule. The target is the best AdamW run's held-out loss at its last step;
for every run the table gives the first evaluated step whose held-out loss is at or below it and the
summed step wall time up to there ("-": never). Speed ratios are printed, not asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

MODELS = {
    # name: model overrides (the 50M one: 12 blocks of width 512 and ffn 2048, 47.2M in blocks + byte vocabulary)
    "tiny": {"model.preset": "debug"},
    "small": {"model.preset": "small"},
    "50m": {"model.preset": "small", "model.dim": 512, "model.n_layers": 12, "model.n_heads": 8,
            "model.n_kv_heads": 4, "model.ffn_dim": 2048},
}


def run(model: dict, optim: str, lr: float, args) -> dict:
    """Train in this process; per step its wall seconds, and the held-out losses by step."""
    import torch
    from meshlm.core import config as C
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.train.trainer import Trainer

    torch.manual_seed(0)
    cfg = C.Config()
    over = {**model, "optim.name": optim, "optim.lr": lr, "optim.warmup": args.steps // 10,
            "training.steps": args.steps, "training.global_batch": args.batch, "training.micro_batch": args.batch,
            "data.seq_len": args.seq_len, "training.eval_every": args.eval_every, "training.eval_batches": 4,
            "training.seed": 1, "metrics.progress": False, "checkpoint.resume": "never", "training.peak_tflops": 1.0}
    for k, v in over.items():
        C.apply(cfg, k, v)
    cfg.check()
    run_dir = tempfile.mkdtemp(prefix="meshlm-muon-bench-")
    layout = build_layout(cfg, 1)
    trainer = Trainer(cfg, run_dir, init_context(layout.shape(), pick_device("cpu")), layout)
    step_s: dict[int, float] = {}
    real = trainer.train_step

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = real(*a, **kw)
        step_s[trainer.state.step] = time.perf_counter() - t0
        return out

    trainer.train_step = timed
    trainer.fit()
    evals = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "eval_loss" in rec:
                evals[rec["step"]] = rec["eval_loss"]
    print(f"[{optim} lr {lr:g}] {len(step_s)} steps in {sum(step_s.values()):.0f} s, held-out by step {evals}",
          file=sys.stderr, flush=True)
    return {"optim": optim, "lr": lr, "evals": evals, "step_s": step_s}


def reach(r: dict, target: float) -> tuple[int | None, float | None]:
    for step in sorted(r["evals"]):
        if r["evals"][step] <= target:
            return step, sum(s for k, s in r["step_s"].items() if k <= step)
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--png", default="")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    results = {}
    print("| model | optimizer | lr | held-out loss at last step | steps to target | wall s to target |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        runs = [run(MODELS[name], o, lr, args) for o in ("adamw", "muon") for lr in args.lrs]
        last = max(runs[0]["evals"])
        best = min((r for r in runs if r["optim"] == "adamw"), key=lambda r: r["evals"][last])
        target = best["evals"][last]
        for r in runs:
            step, secs = reach(r, target)
            r.update(steps_to_target=step, seconds_to_target=secs, target=target)
            print(f"| {name} | {r['optim']} | {r['lr']:g} | {r['evals'][last]:.4f} | {step if step else '-'} | "
                  f"{f'{secs:.1f}' if secs else '-'} |")
        muon = [r for r in runs if r["optim"] == "muon" and r["steps_to_target"]]
        if muon:
            fastest = min(muon, key=lambda r: r["steps_to_target"])
            print(f"{name}: target {target:.4f} (AdamW lr {best['lr']:g}, step {last}); Muon lr {fastest['lr']:g} "
                  f"reaches it at step {fastest['steps_to_target']}: steps ratio "
                  f"{last / fastest['steps_to_target']:.2f}, wall ratio "
                  f"{best['seconds_to_target'] / fastest['seconds_to_target']:.2f}")
        else:
            print(f"{name}: target {target:.4f}; no Muon run reaches it in {last} steps")
        results[name] = runs
    if args.png:
        plot(results, args.png)
    if args.json:
        print(json.dumps({k: [{kk: vv for kk, vv in r.items() if kk != "step_s"} for r in v] for k, v in results.items()}))


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], results.items()):
        for r in runs:
            steps = sorted(r["evals"])
            ax.plot(steps, [r["evals"][s] for s in steps], ls="-" if r["optim"] == "muon" else "--",
                    label=f"{r['optim']} lr {r['lr']:g}")
        ax.axhline(runs[0]["target"], color="grey", lw=0.8)
        ax.set_title(f"{name}: held-out loss")
        ax.set_xlabel("step")
        ax.set_ylim(top=min(max(max(r["evals"].values()) for r in runs), runs[0]["target"] + 1.5))
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
