"""`--calibrate RUN_DIR` for a run on a GPU: the card's profile with its efficiencies fitted from the
CUDA kernels of the run's profiled step (docs/planner.md, "Calibration from a run").

The trace (train/observe/metrics.StepProfiler) is a table of event names: aten ops, autograd nodes, compiled-
graph wrappers ("## Call CompiledFxGraph ... ##"), CUDA API calls, profiler annotations ("Command Buffer
Full") and the kernels themselves. Only kernels are device time: every other event's `device_s` is
the time of kernels it launched, which the kernels' own entries already count. A kernel launched by
Inductor is also a host event of the same name, so its entry holds its time twice. Kernels fall in
three categories by name: GEMM (cuBLAS / cutlass), attention (cuDNN / flash / memory-efficient SDPA)
and element-wise (all the rest: Triton, ATen element-wise, the optimizer's multi_tensor_apply,
memsets); NCCL kernels are communication, priced by the link.

Each category's efficiency is fitted so that the planner's seconds of that category for the run's
own layout equal the kernels' seconds: the GEMM ceiling, a factor on the attention table and the
achieved share of HBM bandwidth. The GPU's idle time per step (the median step less the kernels) is
the per-step overhead. The peak and HBM are the card's (the run's metrics name it), so MFU and memory
are read against the same device the run used.
"""
from __future__ import annotations

import dataclasses

from ..cost.estimate import Options, step_categories, time_model
from ..hardware import GPU, profile_of_device
from ..spec import PlanError, Shape, Spec

# first characters of CUDA kernel and device-activity names (cuBLAS nvjet / sm90_xmma, cuDNN, Triton,
# ATen's `void at::native::...`, CUTLASS, mangled C++ names, NCCL, memsets and copies)
KERNEL_PREFIXES = ("void ", "nvjet_", "cudnn", "triton_", "Memset", "Memcpy", "sm90_", "sm80_", "sm100_",
                   "ampere_", "hopper_", "cutlass", "_Z", "nccl", "fmha", "flash", "cublas")
GEMM_KEYS = ("nvjet", "gemm", "splitkreduce", "cutlass", "cublas", "xmma")
ATTENTION_KEYS = ("sdpa", "fmha", "flash", "cudnn", "attention")


def kernel_category(name: str) -> str | None:
    """gemm, attention, comm or elementwise for a kernel; None for a host event or an annotation."""
    if not name.startswith(KERNEL_PREFIXES):
        return None
    low = name.lower()
    if "nccl" in low:
        return "comm"
    if any(k in low for k in ATTENTION_KEYS):
        return "attention"
    if any(k in low for k in GEMM_KEYS):
        return "gemm"
    return "elementwise"


def kernel_seconds(ops: dict) -> dict:
    """Device seconds of the profiled step per kernel category (see the module docstring)."""
    out = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0, "comm": 0.0}
    for name, o in ops.items():
        cat = kernel_category(name)
        if cat is None or not o.get("device_s"):
            continue
        out[cat] += o["device_s"] / (2 if o.get("self_s", 0) > 0 else 1)  # a launch event of the same name
    return out


def card(peak_label: str | None, peak_flops: float | None) -> GPU:
    """The run's device: the profile its metrics' peak_label names, at the peak the run used for MFU."""
    gpu = profile_of_device(peak_label or "")
    if gpu is None:
        raise PlanError(f"--calibrate: the run's device ({peak_label or 'not logged'}) has no GPU profile "
                        f"(cards.DEVICE_NAMES)")
    return dataclasses.replace(gpu, peak_flops=peak_flops) if peak_flops else gpu


def _parts(shape: Shape, spec: Spec, gpu: GPU, o: Options) -> dict:
    """The planner's kernel seconds of the run's step per category on `gpu` (estimate.step_categories);
    selective AC's recompute is attention, other recompute is shared out like the rest of the step."""
    r = time_model(shape, spec, gpu, o, simulate=False)
    c = step_categories(r)
    out = {"gemm": c["gemm"], "attention": c["attention"],
           "elementwise": c["elementwise"] + c["launch"] + c["loss"] + c["grad_accum"] + c["optimizer"]}
    if spec.ac == "selective":
        out["attention"] += c["recompute"]
    else:
        total = sum(out.values())
        out = {k: v * (1 + c["recompute"] / total) for k, v in out.items()}
    return out


def fit_card(shape: Shape, spec: Spec, compiled: bool, step_s: float, prof: dict | None, peak_label: str | None,
             peak_flops: float | None) -> tuple[GPU, float, dict]:
    """(the fitted card, the per-step overhead seconds, the kernels' seconds per category). Without a
    trace (`prof` None) one factor scales all three efficiencies until the step is the run's median,
    the overhead folded in."""
    gpu = card(peak_label, peak_flops)
    o = Options(compiled=compiled, step_overhead_s=0.0)
    if prof is None:
        for _ in range(8):
            f = time_model(shape, spec, gpu, o, simulate=False)["step_s"] / step_s
            gpu = dataclasses.replace(gpu, gemm_ceiling=gpu.gemm_ceiling * f, attn_scale=gpu.attn_scale * f,
                                      hbm_eff=gpu.hbm_eff * f)
        return gpu, 0.0, {}
    measured = kernel_seconds(prof["ops"])
    for _ in range(6):  # each part is inverse in its efficiency where compute- or bandwidth-bound
        model = _parts(shape, spec, gpu, o)
        if any(measured[k] <= 0 or model[k] <= 0 for k in model):
            raise PlanError("--calibrate: the profile has no GEMM, attention or element-wise kernels "
                            "(is it a CUDA trace of a training step?)")
        gpu = dataclasses.replace(gpu, gemm_ceiling=gpu.gemm_ceiling * model["gemm"] / measured["gemm"],
                                  attn_scale=gpu.attn_scale * model["attention"] / measured["attention"],
                                  hbm_eff=gpu.hbm_eff * model["elementwise"] / measured["elementwise"])
    kernels = sum(v for k, v in measured.items() if k != "comm")
    return gpu, max(0.0, step_s - kernels), measured
