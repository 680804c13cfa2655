"""Single-GPU throughput of meshlm's trainer: tokens/s, TFLOP/s, MFU and peak memory.

Trains each preset (default: llama3-1b, then small and llama3-3b if they fit) at the given sequence
length in bf16 with the largest micro-batch that fits (tried from --max-micro-batch down, halving on
out-of-memory), for --steps measured steps after --warmup. MFU uses the trainer's formula
(6·N + 12·L·d·seq FLOPs per token) against the device's datasheet bf16 peak.

    python bench/gpu.py [--presets llama3-1b,small,llama3-3b] [--seq-len 2048] [--ac selective]
                        [--compile] [--profile] [--offload-compare PRESET] [--json]
                        [--loss-chunks K] [--attn-impl auto|sdpa|flex] [--document-mask]
    python bench/gpu.py --presets "" --fp8-compare llama3-3b --steps 200   # fp8 vs bf16, same shapes
                        [--set training.fp8_recipe=rowwise]
    python bench/gpu.py --smoke        # tiny shape on the CPU (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from meshlm.core import config as C
from meshlm.core.choices import ATTN_IMPLS
from meshlm.core.process import exit_frozen
from meshlm.distributed.mesh import init_context, pick_device
from meshlm.core.layout import build_layout
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
    layout = build_layout(cfg, 1)
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
    tokens = trainer.cfg.training.global_batch * a.seq_len  # global_batch in `extra`: accumulation
    flops = trainer.meter.flops_per_step
    out = {"preset": preset, "params": trainer.args.num_params(), "seq_len": a.seq_len, "micro_batch": mb,
           "step_s": step_s, "steps": len(recs), "step_s_min": min(r["step_s"] for r in recs),
           "step_s_max": max(r["step_s"] for r in recs), "precision": a.precision,
           "tokens_per_s": tokens / step_s, "tflops": flops / step_s / 1e12,
           "mfu": flops / step_s / trainer.meter.peak_flops if trainer.meter.peak_flops else 0.0,
           "peak_label": trainer.meter.peak_label, "peak_mem_gib": recs[-1]["mem"]["peak"] / 2 ** 30,
           "final_loss": recs[-1]["loss"], "tail_loss": statistics.mean(r["loss"] for r in recs[-10:]),
           **measured_energy(recs), **{k.split(".")[-1]: v for k, v in extra.items()}}
    if a.profile and trainer.ctx.device.type == "cuda":
        out["top_kernels"] = profile_step(trainer)
    return out


def measured_energy(recs: list[dict]) -> dict:
    """The device's own energy over the timed steps (NVML through metrics.jsonl, docs/energy.md): joules
    per step and mean watts, or None where a record has no reading (a CPU, a card without the counter)."""
    joules = [r.get("energy_j") for r in recs]
    if not recs or any(j is None for j in joules):
        return {"energy_j_per_step": None, "power_w": None}
    seconds = sum(r["step_s"] for r in recs)
    return {"energy_j_per_step": sum(joules) / len(recs), "power_w": sum(joules) / seconds if seconds else None}


def profile_step(trainer: Trainer, top: int = 15) -> dict:
    """Device time per kernel over one step. Annotation ranges (the optimizer's, compiled regions) show
    up as device events too; they would count their kernels twice, so they are left out."""
    from torch.profiler import ProfilerActivity, profile
    trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(measure=False)
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False):
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    total = sum(per_kernel.values()) or 1.0
    rows = sorted(per_kernel.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {"kernel_ms": total,
            "top": [{"name": k[:90], "cuda_ms": ms, "share": ms / total} for k, ms in rows]}


SYNC_CHECKS = {"fp16": {"training.precision": "fp16"}, "bf16": {"training.precision": "bf16"},
               "fp16-zero2": {"training.precision": "fp16", "parallel.zero": 2}}


def sync_check(a) -> dict[str, str]:
    """Train steps under torch's CUDA sync checker: anything inside `train_step` that waits for the GPU
    (item(), a copy to pageable memory, a data-dependent shape) raises. Includes an fp16 overflow step,
    which the fused optimizer must skip on the device. {layout: "ok" or the error}."""
    out = {}
    for name, extra in SYNC_CHECKS.items():
        trainer, _ = build("debug", 128, 4, 10, a, **extra)
        trainer.train_step(measure=False)  # lazy CUDA / cuBLAS / compile initialisation
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                trainer.train_step(measure=False)
            if trainer.state.scaler.enabled:
                trainer.state.scaler.scale = 2.0 ** 40
                skipped = trainer.train_step(measure=False)["skipped"]
            out[name] = "ok"
        except RuntimeError as e:
            out[name] = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if trainer.state.scaler.enabled and out[name] == "ok" and not bool(skipped):
            out[name] = "the overflow step was not skipped"
    return out


def attempt(preset: str, mb: int, a, extra: dict, script: str = __file__) -> dict | None:
    """One measurement in a fresh process (`script --child SPEC`: this file, or bench/gpu_peers.py for
    its peers); None if it ran out of device memory. A process per try because a failed try can leave
    memory held (compile caches, the exception's frames) that would make every later, smaller try fail too."""
    spec = json.dumps({"preset": preset, "mb": mb, "extra": extra, "args": vars(a)})
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", spec],
                          capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not last.startswith("{"):
        raise RuntimeError(f"{preset} mb {mb} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(last)
    return None if out.get("oom") else out


def child(spec: str, run=None) -> int:
    """The `--child` side of `attempt`: `run(preset, mb, args, **extra)` (default: `measure`), one JSON line."""
    d = json.loads(spec)
    a = argparse.Namespace(**d["args"])
    try:
        out = (run or measure)(d["preset"], d["mb"], a, **d["extra"])
    except torch.OutOfMemoryError:
        out = {"oom": True}
    print(json.dumps(out))
    return 0


def largest_fitting(preset: str, a, sizes: list[int], script: str = __file__, **extra) -> dict | None:
    """The first micro-batch size in `sizes` (largest first) that trains without running out of memory."""
    for mb in sizes:
        r = attempt(preset, mb, a, extra, script)
        if r is not None:
            return r
    return None


def fp8_compare(preset: str, a, sizes: list[int], overrides: dict) -> list[dict]:
    """bf16 at the largest micro-batch that fits, then fp8 (training.precision = "fp8") on the same
    shapes and batches: both rows and their ratios (tokens/s; final and last-10-step mean loss)."""
    bf16 = largest_fitting(preset, a, sizes, **overrides, **{"training.precision": "bf16"})
    if bf16 is None:
        return [{"preset": preset, "fits": False, "precision": "bf16"}]
    fp8 = largest_fitting(preset, a, [bf16["micro_batch"]], **overrides, **{"training.precision": "fp8"})
    if fp8 is None:
        return [bf16, {"preset": preset, "fits": False, "precision": "fp8"}]
    ratio = {"fp8_compare": preset, "micro_batch": bf16["micro_batch"], "steps": a.warmup + a.steps,
             "speedup": fp8["tokens_per_s"] / bf16["tokens_per_s"],
             "final_loss_rel": abs(fp8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"],
             "tail_loss_rel": abs(fp8["tail_loss"] - bf16["tail_loss"]) / bf16["tail_loss"]}
    return [bf16, fp8, ratio]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3-1b,small,llama3-3b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--ac", default="selective")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile per block and the loss (default: on for CUDA)")
    ap.add_argument("--micro-batches", default="16,8,4,2,1", help="sizes to try, largest first")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every run, e.g. model.n_layers=18")
    ap.add_argument("--loss-chunks", type=int, default=None, metavar="K",
                    help="training.loss_chunks: head + loss over K token chunks (0: whole logits)")
    ap.add_argument("--attn-impl", default=None, choices=ATTN_IMPLS, help="model.attn_impl")
    ap.add_argument("--document-mask", action="store_true", help="data.document_mask = true")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of one step")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run for CI")
    ap.add_argument("--offload-compare", default="", metavar="PRESET",
                    help="also run PRESET with and without CPU optimizer offload (zero=1)")
    ap.add_argument("--offload-micro-batch", type=int, default=1, help="micro-batch of both offload runs")
    ap.add_argument("--fp8-compare", default="", metavar="PRESET",
                    help="also run PRESET in bf16 and in fp8 on the same shapes and print the ratios")
    ap.add_argument("--out", default="", help="also write the JSON result to this file")
    ap.add_argument("--sync-check", action="store_true",
                    help="also run train steps under torch's CUDA sync checker (CUDA only)")
    a = ap.parse_args()
    if a.smoke:
        a.presets, a.seq_len, a.micro_batches, a.warmup, a.steps = "debug", 32, "2", 1, 3
        a.device, a.precision = "cpu", "fp32"
    if a.sync_check and pick_device(a.device).type != "cuda":
        ap.error("--sync-check needs a CUDA device")
    if a.compile is None:
        a.compile = pick_device(a.device).type == "cuda"
    pairs, bad = C.parse_overrides([f"--{kv}" for kv in a.set])
    if bad:
        ap.error(f"--set wants KEY=VALUE, got {bad[0]}")
    overrides = dict(pairs)
    for key, value in (("training.loss_chunks", a.loss_chunks), ("model.attn_impl", a.attn_impl),
                       ("data.document_mask", a.document_mask or None)):
        if value is not None:
            overrides[key] = value
    sizes = [int(x) for x in a.micro_batches.split(",")]
    results = []
    for preset in [p for p in a.presets.split(",") if p]:
        r = largest_fitting(preset, a, sizes, **overrides)
        results.append(r or {"preset": preset, "fits": False})
        if not a.json:
            if r is None:
                print(f"{preset}: does not fit even at micro-batch 1")
            else:
                print(f"{preset}: mb {r['micro_batch']} x seq {r['seq_len']}: {r['tokens_per_s']:.0f} tok/s, "
                      f"{r['tflops']:.1f} TFLOP/s, MFU {100 * r['mfu']:.1f}% ({r['peak_label']}), "
                      f"peak {r['peak_mem_gib']:.2f} GiB, loss {r['final_loss']:.3f}"
                      + "".join(f", {k} {r[k]}" for k in ("loss_chunks", "attn_impl", "document_mask") if k in r))
                if "top_kernels" in r:
                    print(f"    one profiled step: {r['top_kernels']['kernel_ms']:.1f} ms of kernels")
                for k in r.get("top_kernels", {}).get("top", []):
                    print(f"    {k['share'] * 100:5.1f}%  {k['cuda_ms']:8.2f} ms  {k['name']}")
    if a.offload_compare:
        for extra in ({}, {"parallel.zero": 1, "parallel.offload": "optimizer"}):
            r = largest_fitting(a.offload_compare, a, [a.offload_micro_batch], **overrides, **extra)
            results.append(r or {"preset": a.offload_compare, "fits": False, **extra})
            if not a.json:
                label = "offload" if extra else "no offload"
                print(f"{a.offload_compare} {label}: " + ("does not fit" if r is None else
                      f"mb {r['micro_batch']}, step {r['step_s'] * 1e3:.0f} ms, peak {r['peak_mem_gib']:.2f} GiB"))
    if a.fp8_compare:
        rows = fp8_compare(a.fp8_compare, a, sizes, overrides)
        results += rows
        if not a.json:
            for r in rows:
                if "fp8_compare" in r:
                    print(f"{r['fp8_compare']} fp8 / bf16 at mb {r['micro_batch']}, {r['steps']} steps: "
                          f"{r['speedup']:.3f}x tokens/s, loss {100 * r['final_loss_rel']:.2f}% apart at the "
                          f"last step, {100 * r['tail_loss_rel']:.2f}% over the last 10")
                elif r.get("fits") is False:
                    print(f"{r['preset']} {r['precision']}: does not fit")
                else:
                    print(f"{r['preset']} {r['precision']}: {r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f}%, "
                          f"peak {r['peak_mem_gib']:.2f} GiB, loss {r['final_loss']:.4f}")
    failed = False
    if a.sync_check:
        checks = sync_check(a)
        failed = any(v != "ok" for v in checks.values())
        results.append({"sync_check": checks})
        if not a.json:
            for k, v in checks.items():
                print(f"sync check {k}: {v}")
    report = {"torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "compile": a.compile, "ac": a.ac, "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    if a.json:
        print(json.dumps(report))
    return 1 if failed else 0


if __name__ == "__main__":
    exit_frozen(main())  # a child process: its exit need not free torch object by object
