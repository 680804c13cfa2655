"""Benchmark (not a test): DiLoCo's payoff on a CPU (docs/diloco.md). The same model, data, seed, tokens
and inner layout (one rank per island, `--islands` of them) as a synchronous DP baseline of the same
world (dp = islands); DiLoCo at H = 8, 32, 128 and streaming DiLoCo (4 fragments, H = 32), fp32 outer
gradients (add rows with --rows). Held-out loss every `--eval-every` steps (rank 0: island 0's model;
right after a whole-model sync that is θ_outer) against tokens, in a PNG; the table gives the final
held-out loss, its gap to synchronous DP at equal tokens, and the bytes moved across islands per GPU
(`comm.outer` of metrics.jsonl) beside DP's reduce bytes (`comm.all_reduce`).

    python bench/diloco.py [--preset debug] [--islands 2] [--steps 512] [--seq-len 64] [--batch 16]
                           [--eval-every 64] [--rows sync h8 h32 h128 stream4] [--png docs/img/diloco.png] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from spawn import spawn_gloo, train_worker  # bench/spawn.py

ROWS = {  # name: (sync_every, fragments, quantize[, outer lr, outer momentum]); "sync": synchronous DP
    "sync": None, "h8": (8, 1, "none"), "h32": (32, 1, "none"), "h128": (128, 1, "none"),
    "stream4": (32, 4, "none"), "h32-int8": (32, 1, "int8"), "stream4-int8": (32, 4, "int8"),
    "h32-avg": (32, 1, "none", 1.0, 0.0),  # plain periodic averaging (local SGD): outer lr 1, no momentum
    "h8-avg": (8, 1, "none", 1.0, 0.0),
}


def make_cfg(a, row):
    from meshlm.core import config as C
    cfg = C.Config()
    over = {"model.preset": a.preset, "data.seq_len": a.seq_len, "training.global_batch": a.batch,
            "training.micro_batch": a.batch // a.islands, "training.steps": a.steps, "training.seed": 1,
            "training.eval_every": a.eval_every, "training.eval_batches": a.eval_batches,
            "optim.lr": a.lr, "optim.warmup": max(1, a.steps // 20), "metrics.progress": False,
            "checkpoint.resume": "never", "training.device": "cpu", "training.peak_tflops": 1.0,
            "training.precision": "fp32", "training.compile": False}
    if ROWS[row] is None:
        over["parallel.dp"] = a.islands
    else:
        h, k, q, lr, mom = (*ROWS[row], 0.7, 0.9)[:5]
        over.update({"parallel.islands": a.islands, "training.outer.sync_every": h, "training.outer.fragments": k,
                     "training.outer.quantize": q, "training.outer.lr": lr, "training.outer.momentum": mom})
    for key, v in over.items():
        C.apply(cfg, key, v)
    return cfg


def run_row(a, row: str) -> dict:
    from meshlm.core import config as C
    run_dir = tempfile.mkdtemp(prefix=f"meshlm-diloco-{row}-")
    t0 = time.time()
    spawn_gloo(train_worker, a.islands, C.to_dict(make_cfg(a, row)), run_dir, timeout=3600)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    steps = [r for r in lines if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in lines if "eval_loss" in r and "loss" not in r]
    outer = sum(r["comm"].get("outer", {}).get("bytes", 0.0) for r in steps)
    reduce = sum(r["comm"].get("all_reduce", {}).get("bytes", 0.0) for r in steps)
    flag = sum(r["comm"].get("outer_flag", {}).get("bytes", 0.0) for r in steps)
    return {"row": row, "setting": ROWS[row], "final_train_loss": steps[-1]["loss"], "evals": evals,
            "final_eval_loss": evals[-1][1], "cross_island_bytes": reduce if ROWS[row] is None else outer,
            "stop_flag_bytes": flag, "tokens": steps[-1]["tokens"], "wall_s": time.time() - t0}


def plot(results: list[dict], path: str, title: str, tokens_per_step: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, payoff) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        curves.plot([s * tokens_per_step for s, _ in r["evals"]], [v for _, v in r["evals"]], label=r["row"], lw=1.2)
    curves.set_xlabel("tokens")
    curves.set_ylabel("held-out loss (island 0)")
    curves.set_title(title, fontsize=9)
    curves.legend()
    base = results[0]["final_eval_loss"]
    for r in results:
        payoff.scatter(max(r["cross_island_bytes"], 1.0) / 1e6, 100 * (r["final_eval_loss"] - base) / base)
        payoff.annotate(r["row"], (max(r["cross_island_bytes"], 1.0) / 1e6, 100 * (r["final_eval_loss"] - base) / base),
                        fontsize=8)
    payoff.set_xscale("log")
    payoff.axhline(0, color="grey", lw=0.5)
    payoff.set_xlabel("bytes across islands per GPU over the run (MB, log)")
    payoff.set_ylabel("held-out loss gap vs synchronous DP (%)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--islands", type=int, default=2)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=64)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--rows", nargs="+", default=["sync", "h8", "h32", "h128", "stream4"], choices=list(ROWS))
    ap.add_argument("--png", default=os.path.join(os.path.dirname(__file__), "..", "docs", "img", "diloco.png"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = ["sync"] + [r for r in a.rows if r != "sync"]
    load0 = os.getloadavg()
    results = [run_row(a, row) for row in rows]
    base = results[0]
    for r in results:
        r["gap_pct"] = 100 * (r["final_eval_loss"] - base["final_eval_loss"]) / base["final_eval_loss"]
        r["bytes_vs_sync"] = r["cross_island_bytes"] / base["cross_island_bytes"]
    plot(results, a.png, f"{a.preset}, {a.islands} islands × 1 rank, seq {a.seq_len}, batch {a.batch}, "
                         f"{a.steps} steps", a.seq_len * a.batch)
    summary = {"preset": a.preset, "islands": a.islands, "steps": a.steps, "seq_len": a.seq_len, "batch": a.batch,
               "lr": a.lr, "load_before": load0, "load_after": os.getloadavg(), "png": a.png,
               "rows": [{k: v for k, v in r.items() if k != "evals"} for r in results]}
    if a.json:
        print(json.dumps(summary))
        return 0
    print(f"{'row':14s} {'H':>4s} {'K':>2s} {'quant':>5s} {'held-out':>9s} {'gap':>7s} {'cross-island MB':>16s} "
          f"{'vs sync':>8s}")
    for r in results:
        h, k, q = (r["setting"] or ("-", "-", "-"))[:3]
        print(f"{r['row']:14s} {h!s:>4s} {k!s:>2s} {q:>5s} {r['final_eval_loss']:9.4f} {r['gap_pct']:+6.2f}% "
              f"{r['cross_island_bytes'] / 1e6:16.3f} {r['bytes_vs_sync']:8.4f}")
    print(f"tokens {base['tokens']}; load {load0[0]:.1f} -> {summary['load_after'][0]:.1f}; plot {a.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
