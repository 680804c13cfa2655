"""The card's own ceilings, in a few seconds: the bf16 GEMM rate at 8192³ and at llama3-1b's block shape,
the same GEMMs in fp8 (e4m3, tensorwise scales, `torch._scaled_mm`) where the card has it, and a
device-to-device copy (bytes read + written). Every timed row of a GPU piece is read against these.
bench/kernels.py measures the full grid; this is its first row, for the headline piece.

    python bench/ceilings.py --out ceilings.json
    python bench/ceilings.py --device cpu --tiny      # plumbing (tests/test_bench_session.py)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from meshlm.core.process import exit_frozen

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as K  # noqa: E402  (Bench: CUDA-event medians; device_info: card, driver, clocks)

# (name, m, k, n): 8192³ as every ceiling elsewhere in the repository; llama3-1b's w13 at 8192 tokens
SHAPES = [("square8192", 8192, 8192, 8192), ("1b-w13", 8192, 2048, 16384)]
TINY = [("square256", 256, 256, 256)]


def gemm(b: K.Bench, m: int, k: int, n: int, fp8: bool) -> float:
    """TFLOP/s of x[m, k] · W[n, k]ᵀ (a linear layer's forward), bf16, or fp8 as torchao feeds it."""
    if fp8:
        x = torch.randn(m, k, device=b.device).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=b.device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=b.device)
        s = b.time(lambda: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    else:
        dt = torch.bfloat16 if b.device.type == "cuda" else torch.float32
        x, w = torch.randn(m, k, device=b.device, dtype=dt), torch.randn(n, k, device=b.device, dtype=dt).t()
        s = b.time(lambda: torch.mm(x, w))
    return 2.0 * m * n * k / s / 1e12


def copy_rate(b: K.Bench, nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=b.device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / b.time(lambda: dst.copy_(src)) / 1e12


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU plumbing run)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "bench/ceilings.py: --device cuda: no CUDA device here (plumbing: --device cpu --tiny)\n")
    device = torch.device(a.device)
    info = K.device_info(device)
    opts = argparse.Namespace(budget_s=60.0, sections=[], no_fp8=False, warmup=3, reps=20, max_measure_s=1.0)
    b = K.Bench(opts, device, K.get_gpu("h100"), info)
    out = {"env": info, "gemm": [], "fp8": b.fp8}
    for name, m, k, n in TINY if a.tiny else SHAPES:
        row = {"gemm": name, "m": m, "k": k, "n": n, "bf16_tflops": gemm(b, m, k, n, fp8=False)}
        if b.fp8:
            row["fp8_tflops"] = gemm(b, m, k, n, fp8=True)
            row["fp8_speedup"] = row["fp8_tflops"] / row["bf16_tflops"]
        out["gemm"].append(row)
        print(f"{name} {m}x{k}x{n}: bf16 {row['bf16_tflops']:.0f} TFLOP/s"
              + (f", fp8 {row['fp8_tflops']:.0f} ({row['fp8_speedup']:.2f}x)" if b.fp8 else ", no fp8 here"))
    out["copy_TBps"] = copy_rate(b, 2 ** 20 if a.tiny else 2 ** 32)
    print(f"device copy: {out['copy_TBps']:.2f} TB/s (read + write)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
    exit_frozen()  # a child process: its exit need not free torch object by object
