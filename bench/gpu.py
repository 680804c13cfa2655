"""Single-GPU throughput of meshlm's trainer: tokens/s, TFLOP/s, MFU and peak memory.

Trains each preset (default: llama3-1b, then small and llama3-3b if they fit) at the given sequence
length in bf16 with the largest micro-batch that fits (tried from --max-micro-batch down, halving on
out-of-memory), for --steps measured steps after --warmup. MFU uses the trainer's formula
(6·N + 12·L·d·seq FLOPs per token) against the device's datasheet bf16 peak.

    python bench/gpu.py [--presets llama3-1b,small,llama3-3b] [--seq-len 2048] [--ac selective]
                        [--compile] [--profile] [--offload-compare PRESET] [--json]
    python bench/gpu.py --smoke        # tiny shape on the CPU (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

from meshlm import config as C
from meshlm.distributed.mesh import init_context, pick_device
from meshlm.layout import resolve
from meshlm.train.trainer import Trainer


def build(preset: str, seq: int, mb: int, steps: int, a, **extra) -> tuple[Trainer, str]:
    cfg = C.Config()
    values = {"model.preset": preset, "data.seq_len": seq, "training.global_batch": mb,
              "training.micro_batch": mb, "training.steps": steps, "training.eval_every": 0,
              "training.precision": a.precision, "training.ac": a.ac, "training.compile": a.compile,
              "metrics.progress": False, "checkpoint.resume": "never", "training.device": a.device,
              "metrics.every": 1, **extra}
    for k, v in values.items():
        C.apply(cfg, k, v)
    run_dir = tempfile.mkdtemp(prefix=f"meshlm-gpu-{preset}-")
    layout = resolve(cfg, 1)
    ctx = init_context(layout.shape(), pick_device(a.device))
    return Trainer(cfg, run_dir, ctx, layout), run_dir


def measure(preset: str, mb: int, a, **extra) -> dict:
    trainer, run_dir = build(preset, a.seq_len, mb, a.warmup + a.steps, a, **extra)
    if trainer.ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if '"step_s"' in line][a.warmup:]
    step_s = statistics.median(r["step_s"] for r in recs)
    tokens = mb * a.seq_len
    flops = trainer.flops_per_step
    out = {"preset": preset, "params": trainer.args.num_params(), "seq_len": a.seq_len, "micro_batch": mb,
           "step_s": step_s, "tokens_per_s": tokens / step_s, "tflops": flops / step_s / 1e12,
           "mfu": flops / step_s / trainer.peak_flops if trainer.peak_flops else 0.0,
           "peak_label": trainer.peak_label, "peak_mem_gib": recs[-1]["mem"]["peak"] / 2 ** 30,
           "final_loss": recs[-1]["loss"], **{k.split(".")[-1]: v for k, v in extra.items()}}
    if a.profile and trainer.ctx.device.type == "cuda":
        out["top_kernels"] = profile_step(trainer)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def profile_step(trainer: Trainer, top: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(measure=False)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:top]
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") or 1
    return [{"name": e.key[:90], "cuda_ms": e.device_time_total / 1e3, "share": e.device_time_total / total}
            for e in rows]


def largest_fitting(preset: str, a, **extra) -> dict | None:
    mb = a.max_micro_batch
    while mb >= 1:
        try:
            return measure(preset, mb, a, **extra)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            mb //= 2
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3-1b,small,llama3-3b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--ac", default="selective")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--max-micro-batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of one step")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run for CI")
    ap.add_argument("--offload-compare", default="", metavar="PRESET",
                    help="also run PRESET with and without CPU optimizer offload (zero=1)")
    a = ap.parse_args()
    if a.smoke:
        a.presets, a.seq_len, a.max_micro_batch, a.warmup, a.steps = "debug", 32, 2, 1, 3
        a.device, a.precision = "cpu", "fp32"
    results = []
    for preset in a.presets.split(","):
        r = largest_fitting(preset, a)
        results.append(r or {"preset": preset, "fits": False})
        if not a.json:
            if r is None:
                print(f"{preset}: does not fit even at micro-batch 1")
            else:
                print(f"{preset}: mb {r['micro_batch']} x seq {r['seq_len']}: {r['tokens_per_s']:.0f} tok/s, "
                      f"{r['tflops']:.1f} TFLOP/s, MFU {100 * r['mfu']:.1f}% ({r['peak_label']}), "
                      f"peak {r['peak_mem_gib']:.2f} GiB, loss {r['final_loss']:.3f}")
                for k in r.get("top_kernels", []):
                    print(f"    {k['share'] * 100:5.1f}%  {k['cuda_ms']:8.2f} ms  {k['name']}")
    if a.offload_compare:
        for extra in ({}, {"parallel.zero": 1, "parallel.offload": "optimizer"}):
            r = largest_fitting(a.offload_compare, a, **extra)
            results.append(r or {"preset": a.offload_compare, "fits": False, **extra})
            if not a.json:
                label = "offload" if extra else "no offload"
                print(f"{a.offload_compare} {label}: " + ("does not fit" if r is None else
                      f"mb {r['micro_batch']}, step {r['step_s'] * 1e3:.0f} ms, peak {r['peak_mem_gib']:.2f} GiB"))
    if a.json:
        print(json.dumps({"torch": torch.__version__,
                          "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
