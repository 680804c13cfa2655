"""Kernel rates on the current device next to the planner's rates for them (plan/cost/ops.py).

The planner prices attention from the FlashAttention-3 paper's Fig. 5 (`ops._FA3_FIG5`, `BWD_RATIO`),
GEMMs from one 8192³ ceiling and a wave-quantization model (`ops.gemm_seconds`) and element-wise work
at HBM bandwidth × hbm_eff; the validation rows that still miss (docs/planner.md, "Validation") name
rates nobody measured. This script measures them:

  attention    torch SDPA with each backend forced (cuDNN, FLASH_ATTENTION = FlashAttention-2,
               EFFICIENT_ATTENTION) and compiled flex_attention (meshlm's model/flex.py path): the FA3
               figure's grid (batch·seq = 16k tokens, hidden 2048, head dim 128 and 64, causal and
               not, seq 512..16384; causal hd 128 also 32K..128K) and the validation rows' own shapes
               (GQA as meshlm runs it, `enable_gqa`); forward and backward TFLOP/s, causal FLOPs
               counted as half, a dense mask's in full, backward 2.5x the forward's
  gemm         the block GEMMs (forward, input gradient, weight gradient, as ops.stage_compute's
               gemm3 prices them; in bf16 and, on sm89+, fp8 e4m3 through torch._scaled_mm as torchao's
               tensorwise float8 runs them, against fp8_gemm_speedup) and the output head of llama3-8b at 16384 tokens, llama3-1b at
               32768, llama3-405b tp8 at 8192, the Megatron 1.7B shape at 32768 and 18.4B tp8 at 16384
  elementwise  a device copy, meshlm's eager RMSNorm (forward, forward + backward) and SiLU·mul
               (forward and its backward's element-wise ops), in the planner's bytes per second

Each row carries the planner's prediction for this device's profile (hardware.profile_of_device, or
--gpu) and measured / predicted (> 1: faster than planned). Each time is the median of --reps runs
after --warmup, by CUDA events (perf_counter on a CPU). A backend that is unavailable, fails or runs
out of memory is skipped with its reason printed and kept in the JSON's "skipped"; cases left when
--budget-s is spent are skipped likewise. The JSON (--out) is rewritten after every case.

    python bench/kernels.py --out kernels.json [--quick] [--budget-s 420] [--sections gemm,attention]
    python bench/kernels.py --device cpu --tiny --out /tmp/kernels.json   # the plumbing, on a CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
sys.path.insert(0, SRC)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_cases beside it

import torch  # noqa: E402

from meshlm.plan.hardware import GPU, HardwareError, get_gpu, profile_of_device  # noqa: E402

from kernel_cases import (  # noqa: E402, F401  (the cases and their predictions; tests read MEGATRON_*, ELEMENTWISE here)
    ATTN_COLUMNS, BWD_FLOPS, DTYPES, ELEMENTWISE, EW_COLUMNS, GEMM_COLUMNS, MEGATRON_1_7B, MEGATRON_18_4B, MODELS,
    TINY_MODELS, attention_cases, attention_flops, elementwise_cases, flex_wanted, fp8_wanted, format_table,
    fwd_bwd_rate, gemm_cases, predicted_attention, predicted_elementwise, predicted_gemm, ratio)

SECTIONS = ("gemm", "elementwise", "attention")
BACKENDS = ("cudnn", "flash", "efficient", "flex", "math")


# ------------------------------------------------------------------ timing and the device

class Bench:
    """Times callables on one device and keeps the results, the skips and the time budget."""

    def __init__(self, a, device: torch.device, gpu: GPU, info: dict):
        self.a, self.device, self.gpu = a, device, gpu
        self.deadline = time.monotonic() + a.budget_s
        self.started = time.monotonic()
        self.out = {"env": info, "gpu_profile": dataclasses.asdict(gpu), "args": vars(a),
                    "attention": [], "gemm": [], "elementwise": [], "skipped": []}
        self.budget_noted = False
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        self.fp8 = bool(cap and cap >= (8, 9) and hasattr(torch, "_scaled_mm")) and not a.no_fp8
        if not self.fp8 and "gemm" in a.sections:
            reason = "--no-fp8" if a.no_fp8 else f"needs CUDA compute capability >= 8.9 (this device: {cap or 'cpu'})"
            print(f"  skip gemm fp8: {reason}")
            self.out["skipped"].append({"section": "gemm", "case": "fp8", "reason": reason})

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time(self, fn) -> float:
        """Median seconds of fn() over --reps runs after --warmup ones; fewer runs (at least 3) where
        one takes long, so that a measurement stays near --max-measure-s."""
        t0 = time.perf_counter()
        for _ in range(max(1, self.a.warmup)):
            t0 = time.perf_counter()
            fn()
            self.sync()
        one = time.perf_counter() - t0
        reps = max(3, min(self.a.reps, int(self.a.max_measure_s / max(one, 1e-9))))
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    def attempt(self, section: str, label: str, measure) -> dict | None:
        """measure() or a skip with its reason (printed, and kept in the JSON)."""
        if time.monotonic() > self.deadline:
            reason = f"time budget (--budget-s {self.a.budget_s:g}) spent"
            if not self.budget_noted:
                print(f"  skipping the cases left: {reason}")
                self.budget_noted = True
            self.out["skipped"].append({"section": section, "case": label, "reason": reason})
            return None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return measure()
            except Exception as e:  # noqa: BLE001 - any failure of one backend skips that case only
                oom = isinstance(e, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
                why = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()][:2]
                first = (str(e).strip().splitlines() or [""])[0]
                reason = ("out of memory: " if oom else f"{type(e).__name__}: ") + first[:200]
                reason += "".join(f" | {w[:160]}" for w in why)
            finally:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        print(f"  skip {section} {label}: {reason}")
        self.out["skipped"].append({"section": section, "case": label, "reason": reason})
        return None

    def run(self, section: str, cases: list, columns: list) -> None:
        """Each (label, measure) in turn: a row printed and saved as it comes, then the section's table."""
        print(format_table([], columns))
        for label, measure in cases:
            row = self.attempt(section, label, measure)
            if row:
                self.out[section].append(row)
                print("  " + format_table([row], columns).splitlines()[1].strip())
                self.save()
        print(format_table(self.out[section], columns))

    def save(self):
        self.out["elapsed_s"] = time.monotonic() - self.started
        if self.a.out:
            with open(self.a.out, "w") as f:
                json.dump(self.out, f, indent=1)


def nvidia_smi() -> dict | None:
    """The card's name, driver, clocks, power and temperature now (None without nvidia-smi)."""
    keys = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={keys}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(keys.split(","), (v.strip() for v in line.split(","))))


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=p.total_memory / 2 ** 30, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), nvidia_smi=nvidia_smi())
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


# ------------------------------------------------------------------ the measurements

def _sdpa_backend(backend: str):
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                                "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}[backend])


def attention_row(b: Bench, case: dict, backend: str) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    dt, dev = DTYPES[case["precision"]], b.device
    B, H, KV, S, D = (case[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    q = torch.randn(B, H, S, D, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(B, KV, S, D, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    gqa = KV != H
    if backend == "flex":
        from meshlm.model.flex import flex_attend, flex_block_mask
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limit falls back to eager flex
        mask = flex_block_mask(None, S, dev) if case["causal"] else None

        def fwd():
            return flex_attend(q, k, v, mask)
    else:
        dense = torch.ones(S, S, device=dev, dtype=torch.bool).tril().expand(B, 1, S, S) \
            if case["mask"] == "dense" else None

        def fwd():
            with sdpa_kernel(_sdpa_backend(backend)):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=case["causal"] and dense is None,
                                                      enable_gqa=gqa)
    fwd_s = b.time(fwd)
    out = fwd()
    go = torch.randn_like(out)
    bwd_s = b.time(lambda: torch.autograd.grad(out, (q, k, v), go, retain_graph=True))
    del out, go
    flops = attention_flops(case)
    row = dict(case, backend=backend, flops_fwd=flops, fwd_s=fwd_s, bwd_s=bwd_s, fwdbwd_s=fwd_s + bwd_s,
               fwd_tflops=flops / fwd_s / 1e12, bwd_tflops=BWD_FLOPS * flops / bwd_s / 1e12,
               fwdbwd_tflops=(1 + BWD_FLOPS) * flops / (fwd_s + bwd_s) / 1e12)
    pred = predicted_attention(case, backend, b.gpu)
    row["planner_kernel"] = pred["kernel"] if pred else None
    if pred:
        row.update(pred_fwd_tflops=pred["fwd"] / 1e12, pred_bwd_tflops=pred["bwd"] / 1e12,
                   pred_fwdbwd_tflops=fwd_bwd_rate(pred["fwd"], pred["bwd"]) / 1e12)
    for part in ("fwd", "bwd", "fwdbwd"):
        row[f"ratio_{part}"] = ratio(row[f"{part}_tflops"], row.get(f"pred_{part}_tflops"))
    return row


def gemm_row(b: Bench, case: dict) -> dict:
    dt, dev, T, n, k = DTYPES[case["precision"]], b.device, case["tokens"], case["n"], case["k"]
    if case["role"] == "fwd":      # x[T, k] · W[n, k]ᵀ
        x, y = torch.randn(T, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt).t()
    elif case["role"] == "dgrad":  # g[T, n] · W[n, k]
        x, y = torch.randn(T, n, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt)
    else:                          # g[T, n]ᵀ · x[T, k]
        x, y = torch.randn(T, n, device=dev, dtype=dt).t(), torch.randn(T, k, device=dev, dtype=dt)
    s = b.time(lambda: torch.mm(x, y))
    m_, n_, k_ = case["mnk"]
    pred, wave = predicted_gemm(case, b.gpu)
    tflops = 2.0 * m_ * n_ * k_ / s / 1e12
    row = dict(case, shape=f"{m_},{n_},{k_}", seconds=s, tflops=tflops, pred_tflops=pred / 1e12, wave=wave,
               ratio=ratio(tflops, pred / 1e12))
    if b.fp8 and fp8_wanted(case):  # its own attempt: a failure skips the fp8 run, not the bf16 row
        del x, y
        found = b.attempt("gemm", f"{case['group']} {case['weights']} {case['role']} {case['mnk']} fp8",
                          lambda: _fp8_gemm(b, case))
        if found:
            row.update(found, fp8_speedup=s / found["fp8_seconds"])
    return row


def _fp8_gemm(b: Bench, case: dict) -> dict:
    """e4m3 operands with tensorwise scales through torch._scaled_mm (torchao's default float8 recipe),
    A row-major and B column-major as _scaled_mm takes them."""
    m, n, k = case["mnk"]
    a8 = torch.randn(m, k, device=b.device).to(torch.float8_e4m3fn)
    b8 = torch.randn(n, k, device=b.device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=b.device)
    s8 = b.time(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    tflops, pred = 2.0 * m * n * k / s8 / 1e12, predicted_gemm(case, b.gpu, fp8=True)[0] / 1e12
    return {"fp8_seconds": s8, "fp8_tflops": tflops, "pred_fp8_tflops": pred, "fp8_ratio": ratio(tflops, pred)}


def _silu_mul_bwd(gp, gate, up):
    """The element-wise part of model/ops.py's SwiGLU backward: silu rebuilt, the up and gate
    gradients, the product rebuilt for w2's weight gradient (5 kernels, ops._eager's swiglu_b)."""
    silu = torch.nn.functional.silu(gate)
    g_up = gp * silu
    g_gate = torch.ops.aten.silu_backward(gp.mul(up), gate)
    return g_up, g_gate, silu.mul_(up)


def elementwise_row(b: Bench, case: dict) -> dict:
    from meshlm.model.ops import rms_norm

    dt, dev, T, W = DTYPES[case["precision"]], b.device, case["tokens"], case["width"]
    x = torch.randn(T, W, device=dev, dtype=dt)
    op = case["op"]
    if op == "copy":
        dst = torch.empty_like(x)
        fn = lambda: dst.copy_(x)  # noqa: E731
    elif op.startswith("rmsnorm"):
        w = torch.ones(W, device=dev, dtype=dt, requires_grad=True)
        if op == "rmsnorm_fwd":
            fn = lambda: rms_norm(x, w, 1e-5)  # noqa: E731
        else:
            xg, g = x.clone().requires_grad_(True), torch.randn_like(x)
            fn = lambda: torch.autograd.grad(rms_norm(xg, w, 1e-5), (xg, w), g)  # noqa: E731
    else:
        up, gp = torch.randn_like(x), torch.randn_like(x)
        fn = (lambda: torch.nn.functional.silu(x) * up) if op == "silu_mul_fwd" else (lambda: _silu_mul_bwd(gp, x, up))
    with torch.no_grad() if op in ("copy", "silu_mul_fwd", "silu_mul_bwd") else torch.enable_grad():
        s = b.time(fn)
    pred = predicted_elementwise(case, b.gpu)
    return dict(case, seconds=s, ms=s * 1e3, bytes=pred["bytes"], kernels=pred["kernels"],
                gbps=pred["bytes"] / s / 1e9, pred_gbps=pred["bw"] / 1e9, pred_ms=pred["seconds"] * 1e3,
                ratio=pred["seconds"] / s)


# ------------------------------------------------------------------ the run

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU plumbing test)")
    p.add_argument("--quick", action="store_true", help="fewer attention points")
    p.add_argument("--out", default="", help="the JSON file (rewritten after every case)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--backends", default="", help=f"attention backends of {', '.join(BACKENDS)} "
                   "(default: cudnn,flash,efficient,flex on CUDA, math on a CPU)")
    p.add_argument("--gpu", default="", help="planner profile for the predictions (default: the device's; "
                   "h100 on a CPU or an unknown card)")
    p.add_argument("--no-fp8", action="store_true", help="no fp8 (torch._scaled_mm) run of the block GEMMs")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--max-measure-s", type=float, default=2.0, help="fewer reps (>= 3) past this per measurement")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no case after this many seconds")
    a = p.parse_args(argv)
    err = None
    sections = [s for s in a.sections.split(",") if s]
    backends = [s for s in a.backends.split(",") if s] or (["math"] if a.device == "cpu" else list(BACKENDS[:4]))
    if bad := [s for s in sections if s not in SECTIONS]:
        err = f"--sections: unknown {','.join(bad)} (known: {', '.join(SECTIONS)})"
    elif bad := [s for s in backends if s not in BACKENDS]:
        err = f"--backends: unknown {','.join(bad)} (known: {', '.join(BACKENDS)})"
    elif a.device == "cpu" and not a.tiny:
        err = "--device cpu: only the --tiny shapes run on a CPU"
    elif a.device == "cuda" and not torch.cuda.is_available():
        err = "--device cuda: no CUDA device here (the CPU plumbing run is --device cpu --tiny)"
    elif a.reps < 1 or a.warmup < 0 or a.budget_s <= 0 or a.max_measure_s <= 0:
        err = "--reps must be >= 1, --warmup >= 0, --budget-s and --max-measure-s > 0"
    if err:
        p.exit(2, f"bench/kernels.py: {err}\n")
    a.sections, a.backends = sections, backends
    return a


def planner_gpu(a, info: dict) -> GPU:
    if a.gpu:
        try:
            return get_gpu(a.gpu)
        except HardwareError as e:
            sys.exit(f"bench/kernels.py: {e}")
    found = profile_of_device(info["name"]) if a.device == "cuda" else None
    if found is None:
        print(f"planner profile: h100 (no profile for {info['name']!r}; --gpu picks one)")
    return found or get_gpu("h100")


def main(argv=None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    info = device_info(device)
    gpu = planner_gpu(a, info)
    b = Bench(a, device, gpu, info)
    print(f"torch {info['torch']} on {info['name']}; planner profile {gpu.name} (peak {gpu.peak_flops / 1e12:.0f} "
          f"TFLOP/s, HBM {gpu.hbm_bw / 1e12:.2f} TB/s × {gpu.hbm_eff}, GEMM ceiling {gpu.gemm_ceiling})")
    if info.get("nvidia_smi"):
        print("card:", ", ".join(f"{k}={v}" for k, v in info["nvidia_smi"].items()))
    models = TINY_MODELS if a.tiny else MODELS
    if "gemm" in a.sections:
        print("\n== GEMMs: the validation rows' block GEMMs and heads at their tokens per micro-batch")
        b.run("gemm", [(f"{c['group']} {c['weights']} {c['role']} {c['mnk']}", lambda c=c: gemm_row(b, c))
                       for c in gemm_cases(models)], GEMM_COLUMNS)
    if "elementwise" in a.sections:
        print("\n== element-wise (eager), bytes as the planner counts them (ops._eager)")
        b.run("elementwise", [(c["op"], lambda c=c: elementwise_row(b, c)) for c in elementwise_cases(a.tiny)],
              EW_COLUMNS)
    if "attention" in a.sections:
        print("\n== attention: TFLOP/s (causal counted half, backward 2.5x the forward FLOPs)")
        cases = attention_cases(a.quick, a.tiny, models)
        plan = [(c, be) for c in cases for be in a.backends if be != "flex"]
        plan += [(c, "flex") for c in cases if "flex" in a.backends and flex_wanted(c, a.quick, a.tiny)]
        b.run("attention", [(f"{be} {c['group']} B{c['batch']} H{c['heads']}/{c['kv_heads']} S{c['seq']} "
                             f"hd{c['head_dim']}{' causal' if c['causal'] else ''}"
                             f"{' dense-mask' if c['mask'] == 'dense' else ''}", lambda c=c, be=be: attention_row(b, c, be))
                            for c, be in plan], ATTN_COLUMNS)
    if device.type == "cuda":
        b.out["env"]["nvidia_smi_end"] = nvidia_smi()
    b.save()
    print(f"\n{len(b.out['skipped'])} skipped; {b.out['elapsed_s']:.0f} s" + (f"; wrote {a.out}" if a.out else ""))
    return b.out


if __name__ == "__main__":
    main()
