"""What an overlapped collective costs the GEMMs it overlaps, on one GPU (issue 47's `overlap` piece).

NCCL runs a collective as a kernel of a bounded number of CTAs (8-32 channels) that stays resident for
the whole transfer and streams bytes through HBM at the link's rate. This measures a bf16 GEMM of the
validation rows' shapes alone, then while such a kernel runs on another stream: a persistent Triton
copy kernel with C CTAs, each paced by the GPU's global timer to a share of a target rate (NVLink-like
450 GB/s, InfiniBand-like 50 GB/s), swept over C = 8, 16, 32, plus one unpaced run (as fast as C CTAs
copy). The slowdown (contended / alone - 1) is the number the planner's `GPU.overlap_slowdown` takes.
Without Triton (a CPU) a Python thread copying tensors stands in for the kernel: that is plumbing only.

    python bench/overlap.py --out overlap.json
    python bench/overlap.py --device cpu --tiny        # plumbing (tests/test_bench_session.py)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ledger  # noqa: E402

GB = 1e9
# (name, m, k, n): llama3-8b's w13 and wo forward at 16384 tokens, llama3-70b tp8's w13 at 8192
SHAPES = [("8b-w13", 16384, 4096, 28672), ("8b-wo", 16384, 4096, 4096), ("70b-tp8-w13", 8192, 8192, 7168)]
TINY = [("tiny", 128, 128, 128)]
RATES = {"nvlink": 450 * GB, "ib": 50 * GB, "unpaced": 0.0}
CTAS = (8, 16, 32)


def pacer_kernel():
    """A Triton kernel: each of the grid's CTAs copies BLOCK-element chunks from src to dst (wrapping
    around the buffer) until `duration_ns` has passed, waiting after chunk i until the global timer says
    i chunks are due at its share of the rate (`ns_per_chunk`; 0: unpaced). Chunks done go to `count`."""
    import triton
    import triton.language as tl

    @triton.jit
    def now(x):
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def pace(src, dst, count, n_chunks, duration_ns, ns_per_chunk, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        ctas = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        t0 = now(pid)
        t = t0
        i = 0
        while t - t0 < duration_ns:
            chunk = (pid + i * ctas) % n_chunks
            tl.store(dst + chunk * BLOCK + offs, tl.load(src + chunk * BLOCK + offs))
            i += 1
            t = now(pid)
            while t - t0 < i * ns_per_chunk:
                t = now(pid)
        tl.store(count + pid, i)

    return pace


class Interferer:
    """The bandwidth-bound kernel on its own stream (CUDA), or a copying thread (CPU plumbing)."""
    BLOCK = 4096  # bf16 elements per chunk: 8 KiB read + 8 KiB written

    def __init__(self, device: torch.device, nbytes: int):
        self.device = device
        self.src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        self.dst = torch.empty_like(self.src)
        self.kernel, self.why = None, "no CUDA: a copying thread (plumbing)"
        if device.type == "cuda":
            try:
                self.kernel, self.why = pacer_kernel(), "triton, paced"
            except Exception as e:  # noqa: BLE001 - no Triton: whole-tensor copies stand in, unpaced
                self.why = f"torch copies on a side stream (no paced kernel: {str(e).splitlines()[0][:120]})"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, ctas: int, rate: float, seconds: float) -> None:
        chunk_bytes = 2 * self.BLOCK * 2  # read + written, as a link's bytes through HBM
        self.t0, self.seconds, self.ctas = time.perf_counter(), seconds, ctas
        if self.kernel is not None:
            try:
                return self._launch(ctas, rate, seconds, chunk_bytes)
            except Exception as e:  # noqa: BLE001 - the kernel failed to build: copies stand in from now on
                self.kernel, self.why = None, f"torch copies on a side stream ({str(e).splitlines()[0][:120]})"
        if self.kernel is None:
            self.done = 0
            self.thread = threading.Thread(target=self._copy_until, args=(seconds,), daemon=True)
            self.thread.start()

    def _launch(self, ctas: int, rate: float, seconds: float, chunk_bytes: int) -> None:
        self.count = torch.zeros(ctas, dtype=torch.int64, device=self.device)
        ns_per_chunk = int(chunk_bytes / (rate / ctas) * 1e9) if rate else 0
        n_chunks = self.src.numel() // self.BLOCK
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.kernel[(ctas,)](self.src, self.dst, self.count, n_chunks, int(seconds * 1e9), ns_per_chunk,
                                 BLOCK=self.BLOCK)

    def _copy_until(self, seconds: float) -> None:
        while time.perf_counter() - self.t0 < seconds:
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self.dst.copy_(self.src)
                self.stream.synchronize()
            else:
                self.dst.copy_(self.src)
            self.done += 1

    def finish(self) -> float:
        """Achieved rate of the interferer (bytes read + written per second)."""
        if self.kernel is None:
            self.thread.join()
            return self.done * 2 * self.src.numel() * 2 / self.seconds
        self.stream.synchronize()
        return int(self.count.sum()) * 2 * self.BLOCK * 2 / self.seconds


def time_gemm(x, w, reps: int) -> list[float]:
    """Seconds of each of `reps` GEMMs, CUDA events on the current stream (host clock on a CPU)."""
    out = []
    for _ in range(reps):
        if x.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.mm(x, w)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            torch.mm(x, w)
            out.append(time.perf_counter() - t)
    return out


def measure(shape, inter: Interferer, reps: int, rates: dict, ctas) -> list[dict]:
    name, m, k, n = shape
    dev = inter.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt).t()
    time_gemm(x, w, 3)
    alone = statistics.median(time_gemm(x, w, reps))
    rows = []
    for link, rate in rates.items():
        for c in ctas:
            window = max(0.05, 3 * reps * alone)  # the copy outlasts the GEMMs timed under it
            inter.start(c, rate, window)
            if dev.type == "cuda":
                torch.cuda._sleep(2_000_000)  # let the interferer's CTAs take their SMs first
            under = statistics.median(time_gemm(x, w, reps))
            achieved = inter.finish()
            rows.append({"gemm": name, "mnk": [m, n, k], "link": link, "ctas": c, "target_GBps": rate / GB,
                         "achieved_GBps": achieved / GB, "alone_s": alone, "contended_s": under,
                         "interferer": inter.why, "slowdown": under / alone - 1, "tflops_alone": 2 * m * n * k / alone / 1e12})
            print(f"{name} {link:>7} {c:>2} CTAs: {achieved / GB:7.0f} GB/s moved, GEMM {alone * 1e3:.3f} -> "
                  f"{under * 1e3:.3f} ms ({100 * rows[-1]['slowdown']:+.1f}%)", flush=True)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes, one CTA count (the CPU plumbing run)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "bench/overlap.py: --device cuda: no CUDA device here (plumbing: --device cpu --tiny)\n")
    if a.device == "cpu" and not a.tiny:
        p.exit(2, "bench/overlap.py: --device cpu runs only the --tiny shapes\n")
    dev = torch.device(a.device)
    inter = Interferer(dev, 2 ** 20 if a.tiny else 2 ** 30)
    rates = {"nvlink": RATES["nvlink"]} if a.tiny else RATES
    report = {"env": ledger.environment(a.device), "reps": a.reps, "rows": [], "summary": {}}
    for shape in TINY if a.tiny else SHAPES:
        report["rows"] += measure(shape, inter, a.reps, rates, CTAS[:1] if a.tiny else CTAS)
        if a.out:
            ledger.write_json(a.out, report)
    for link in rates:  # the mean slowdown per link over shapes and CTA counts: what the planner would take
        s = [r["slowdown"] for r in report["rows"] if r["link"] == link]
        report["summary"][link] = {"mean_slowdown": statistics.mean(s), "max_slowdown": max(s)}
    if a.out:
        ledger.write_json(a.out, report)
    print("summary:", json.dumps(report["summary"]))
    return report


if __name__ == "__main__":
    main()
