"""Per-operation compute time of one pipeline stage's micro-batch: the planner's model of the math.

Why: one fixed fraction of peak for all model math made compile and model size change nothing, while
measured runs differ by 1.5x between eager and compiled and small shapes run far below large ones.
Every operation is priced by what bounds it:
  GEMM       max(FLOPs / (peak · ceiling · wave), bytes / HBM) — `ceiling` is the GPU's measured large
             bf16 GEMM fraction, `wave` the wave quantization of 128×256 output tiles over the SMs;
  attention  FLOPs / (peak · kernel fraction at this sequence length and head dim), causal FLOPs
             counted as half (FlashAttention-3 paper, Shah et al. 2024, Fig. 5: H100 SXM5 bf16);
  element-   bytes / (HBM bandwidth · hbm_eff): norms, RoPE, SwiGLU product, residual adds, casts,
  wise       loss; eager PyTorch runs each op as its own kernel with fp32 intermediates, compile fuses
             a region into one kernel that reads its inputs and writes its outputs once;
  launch     every kernel costs at least one host dispatch (eager op or compiled Triton launch).
Byte counts per token follow meshlm's code (model/llama.py, model/ops.py); the tables below say where
each number comes from. Nothing here is fitted to a validation row (tests/test_plan_validation.py).
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache

from .hardware import GPU
from .memory import vocab_rows

# ------------------------------------------------------------------ attention kernels
# Fraction of the dense bf16 peak (989 TFLOP/s) reached by the forward kernel, by sequence length, read
# off the bar labels of FlashAttention-3 (Shah et al. 2024) Fig. 5 (H100 80GB SXM5, batch·seq = 16k,
# hidden 2048). `nc`: causal = False, `c`: causal = True (FLOPs of a causal call counted as half).
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
_FA3_FIG5 = {  # kernel -> head_dim -> causal? -> TFLOP/s at SEQS
    "fa2": {128: {False: (309, 350, 362, 368, 370, 370), True: (191, 260, 298, 319, 333, 335)},
            64: {False: (282, 306, 318, 321, 322, 324)}},
    "cudnn": {128: {False: (497, 574, 617, 609, 600, 595), True: (315, 410, 484, 518, 529, 539)},
              64: {False: (335, 373, 395, 408, 412, 413)}},
    "fa3": {128: {False: (467, 565, 625, 638, 646, 648), True: (292, 423, 521, 579, 602, 616)},
            64: {False: (333, 392, 460, 476, 496, 497)}},
}
H100_PEAK_TFLOPS = 989.0  # the figure's GPU; its fractions carry over to GPUs of the same kernels
# Backward rate / forward rate. cudnn: meshlm's profiled llama3-1b step on one H100 (docs/benchmarks.md,
# "Where the time goes": forward 5.1% of 498 ms for two forwards under selective AC, backward 6.9% with
# 2.5x the forward's FLOPs) -> (2.5·25.4) / (2·34.4) = 0.92. fa2 and fa3: FlashAttention-2 paper (Dao
# 2023) reports up to 73% of peak forward and 63% backward on A100 -> 0.86 (fa3 assumed the same).
BWD_RATIO = {"cudnn": 0.92, "fa2": 0.86, "fa3": 0.86}
# A100: FlashAttention-2 (Dao 2023) reaches 73% of the A100's peak forward at long sequences (its
# headline number, hd 128); the H100 FA2 curve's shape (fraction of its own plateau) is used for shorter
# ones. Only `fa2` is offered there (cuDNN / FA3 Hopper kernels do not exist on sm80).
A100_FA2_PLATEAU = 0.73
KERNELS = tuple(_FA3_FIG5)


def _interp(seq: float, values: tuple) -> float:
    """Log-linear in sequence length between the figure's points, clamped at its ends."""
    if seq <= SEQS[0]:
        return values[0] * seq / SEQS[0]  # below 512 a tile is partly empty: work scales down with seq
    if seq >= SEQS[-1]:
        return values[-1]
    i = bisect_left(SEQS, seq)
    lo, hi = SEQS[i - 1], SEQS[i]
    w = (math.log(seq) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return values[i - 1] + w * (values[i] - values[i - 1])


@lru_cache(maxsize=4096)
def attention_fraction(kernel: str, head_dim: int, seq: int, causal: bool, arch: str = "hopper") -> float:
    """Forward fraction of peak. Head dims other than 64 / 128 use the nearer; causal at hd 64 (not in
    the figure) is the non-causal value times the same kernel's causal / non-causal ratio at hd 128."""
    table = _FA3_FIG5["fa2" if arch == "ampere" else kernel]
    hd = 64 if head_dim <= 96 else 128
    nc = _interp(seq, table[hd][False])
    if causal:
        nc *= _interp(seq, table[128][True]) / _interp(seq, table[128][False])
    if arch == "ampere":  # the H100 FA2 curve scaled to FA2's A100 plateau
        return A100_FA2_PLATEAU * nc / table[hd][False][-1]
    return nc / H100_PEAK_TFLOPS


# ------------------------------------------------------------------ a calibrated machine (CPU)

@dataclass(frozen=True)
class Rates:
    """One rank's rates fitted from a profiled run (plan/calibrate.py), replacing the GPU tables: the
    model's work per category over them. On a CPU every category is priced as a sum (one core does
    the GEMM, then the element-wise op, then dispatches the next), not as the GPU's max of bounds."""
    gemm_flops_s: float      # GEMM FLOPs (2mnk) per second
    attn_flops_s: float      # attention-core FLOPs (causal counted half, backward 2.5x) per second
    ew_bytes_s: float        # element-wise bytes (the tables below) per second
    dispatch_s: float        # seconds per element-wise kernel of the tables below (eager op dispatch)
    step_overhead_s: float = 0.0  # per step, outside every op (Python, the autograd engine's gaps)


UNIT = 1e300  # a rate at which a category costs nothing: Rates with one category at 1 give its work


def unit_rates(category: str) -> Rates:
    """Rates under which the model's seconds are one category's work (FLOPs, bytes or kernels)."""
    r = {"gemm": (1.0, UNIT, UNIT, 0.0), "attention": (UNIT, 1.0, UNIT, 0.0), "bytes": (UNIT, UNIT, 1.0, 0.0),
         "dispatch": (UNIT, UNIT, UNIT, 1.0)}[category]
    return Rates(*r)


# ------------------------------------------------------------------ GEMMs

TILE = (128, 256)  # output tile of the sm80 / sm90 cuBLAS bf16 kernels (nvjet_sm90_tst_256x128 in the
# H100 profile of docs/benchmarks.md; NVIDIA "Matrix Multiplication Background User's Guide" for A100)


def wave_efficiency(m: float, n: float, sms: int, k: float = 0.0) -> float:
    """Busy fraction of the SMs over the GEMM's waves of output tiles (NVIDIA's wave quantization).
    With fewer tiles than SMs (a weight gradient: small m×n, long k) cuBLAS splits k across SMs
    (split-K / Stream-K, Osama et al. 2023): the units of work become tiles × k-slices of 64, split
    evenly, so only the last partial wave of those is lost."""
    tiles = min(math.ceil(m / TILE[0]) * math.ceil(n / TILE[1]), math.ceil(m / TILE[1]) * math.ceil(n / TILE[0]))
    if tiles < sms and k > 0:
        tiles *= min(math.ceil(k / 64), math.ceil(sms / tiles))
    return min(1.0, tiles / (math.ceil(tiles / sms) * sms))


def gemm_seconds(m: float, n: float, k: float, gpu: GPU, e: int, peak: float) -> float:
    """One (m×k)·(k×n) GEMM: compute at the GPU's measured large-GEMM ceiling (divided by that
    measurement's own wave efficiency, 8192³) times this shape's wave efficiency, or HBM traffic."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    intrinsic = gpu.gemm_ceiling / wave_efficiency(8192, 8192, gpu.sms)
    t_c = 2.0 * m * n * k / (peak * intrinsic * wave_efficiency(m, n, gpu.sms, k))
    t_m = e * (m * k + k * n + m * n) / (gpu.hbm_bw * gpu.hbm_eff)
    return max(t_c, t_m)


# ------------------------------------------------------------------ element-wise work
# Bytes per token per unit of width, and kernels, of meshlm's element-wise code (e = activation bytes):
# eager counts each PyTorch op of model/llama.py and model/ops.py (fp32 upcasts included), compiled one
# fused kernel per region that reads its inputs and writes its outputs. (bytes(e), kernels) per unit.

def _eager(e: int) -> dict:
    return {
        # RMSNorm forward: upcast, pow, mean, rsqrt(+eps), x·rstd, cast, ·weight
        "norm_f": ((e + 4) + 8 + 4 + 8 + (4 + e) + 2 * e, 7),
        # its backward: x̂ rebuilt, weight-grad product + row sum, g·weight, upcast, g·x̂, mean, the
        # difference and the scaling, cast back
        "norm_b": (11 * e + 68, 13),
        # RoPE on q or k: upcast, 4 products, 2 sums, stack, cast back; backward about the same again
        "rope_f": (48 + 2 * e, 9), "rope_b": (48 + 2 * e, 9),
        "add": (3 * e, 1),             # a residual add (forward), or the gradient sum at a branch
        "copy": (2 * e, 1),            # the attention output's transpose to [B, S, H·D] (and back)
        # SwiGLU product in swiglu_down: silu, product (forward); silu again, gp·silu, gp·up,
        # silu_backward, product rebuilt (backward). An opaque custom op under compile too.
        "swiglu_f": (5 * e, 2), "swiglu_b": (14 * e, 5),
    }


def _compiled(e: int) -> dict:
    return {
        "norm_f": (2 * e, 1), "norm_b": (3 * e, 1),  # x in, out; g, x in, dx out (+ partial weight sums)
        "rope_f": (2 * e, 0.5), "rope_b": (2 * e, 0.5),  # q and k in one kernel
        "add": (0.0, 0),               # fused into the neighbouring norm's kernel (it reads both anyway)
        "copy": (0.0, 0),              # fused into the RoPE / wo-input kernels
        "swiglu_f": (5 * e, 2), "swiglu_b": (14 * e, 5),  # model/ops.py: the custom op stays eager
    }


# the loss per token and vocabulary row: eager upcasts the logits to fp32 for log_softmax (two passes)
# and its backward writes two fp32 vocab-sized gradients and a cast; compiled reads the bf16 logits
# once for the statistics and once in backward to write the gradient (docs/planner.md, compiled loss)
def _loss(e: int, compiled: bool) -> tuple[float, int]:
    return (3 * e, 3) if compiled else ((e + 4) + 12 + 12 + (4 + e), 8)


def elementwise(a, t: int, sp: bool, compiled: bool, e: int) -> tuple[float, float, float, float]:
    """(forward bytes, backward bytes, forward kernels, backward kernels) per token of one block."""
    ops = _compiled(e) if compiled else _eager(e)
    d_norm = a.dim / t if sp and t > 1 else a.dim  # SP norms run on the token shard: d/t per token
    q = a.n_heads // t * a.head_dim
    k = -(-a.n_kv_heads // t) * a.head_dim
    f = a.ffn_dim / t
    fwd = 2 * ops["norm_f"][0] * d_norm + ops["rope_f"][0] * (q + k) + ops["copy"][0] * q \
        + 2 * ops["add"][0] * d_norm + ops["swiglu_f"][0] * f
    bwd = 2 * ops["norm_b"][0] * d_norm + ops["rope_b"][0] * (q + k) + ops["copy"][0] * q \
        + 2 * ops["add"][0] * d_norm + ops["swiglu_b"][0] * f
    kf = 2 * ops["norm_f"][1] + 2 * ops["rope_f"][1] + ops["copy"][1] + 2 * ops["add"][1] + ops["swiglu_f"][1]
    kb = 2 * ops["norm_b"][1] + 2 * ops["rope_b"][1] + ops["copy"][1] + 2 * ops["add"][1] + ops["swiglu_b"][1]
    return fwd, bwd, kf, kb


def _parts(seconds: float, kernels: float, launch: float, cpu: bool) -> tuple[float, float]:
    """(data seconds, launch seconds) of a group of kernels. On a GPU the group takes its device time or
    its host dispatches, whichever is longer: launches count only where they exceed the kernels. On a
    CPU the core that dispatches an op also runs it: the two add up."""
    return (seconds, kernels * launch) if cpu else (seconds, max(0.0, kernels * launch - seconds))


@lru_cache(maxsize=65536)
def stage_compute(shape, t: int, sp: bool, ep: int, seq_len: int, cp: int, layers: int, head: bool,
                  tokens: float, ac: str, precision: str, gpu: GPU, compiled: bool, flash: bool,
                  kernel: str, attn_dropout: bool = False, rates: Rates | None = None,
                  recompute_gemms: tuple = ()) -> dict:
    """Seconds of one micro-batch on one rank of a stage: forward, backward, recompute and the
    attention kernels alone (the window ring-CP transfers hide behind), plus the per-op breakdown."""
    a = shape.args
    e = 4 if precision == "fp32" else 2
    peak = gpu.peak(precision)
    launch = gpu.launch_compiled_s if compiled else gpu.launch_eager_s
    q = a.n_heads // t * a.head_dim
    kv = -(-a.n_kv_heads // t) * a.head_dim
    f = a.ffn_dim / t
    d = a.dim
    T = tokens

    def gemm(m, n, k):
        if rates is not None:
            return 2.0 * m * n * k / rates.gemm_flops_s if m > 0 and n > 0 and k > 0 else 0.0
        return gemm_seconds(m, n, k, gpu, e, peak)

    def gemm3(m, n, k):  # forward, and backward's input-gradient and weight-gradient GEMMs
        return gemm(m, n, k), gemm(m, k, n) + gemm(k, n, m)

    shapes = [("wq", T, q, d), ("wk", T, kv, d), ("wv", T, kv, d), ("wo", T, d, q)]
    moe_frac = a.n_moe_blocks / a.n_layers if shape.moe else 0.0
    dense_ffn = [("w1", T, f, d), ("w3", T, f, d), ("w2", T, d, f)]
    g_f = g_b = g_rc = 0.0
    for w, group in ((1.0, shapes), (1.0 - moe_frac, dense_ffn)):  # MoE blocks replace the dense FFN
        for name, *sh in group:
            x, y = gemm3(*sh)
            g_f, g_b = g_f + w * x, g_b + w * y
            g_rc += w * x if name in recompute_gemms else 0.0
    if moe_frac:  # balanced routing: each local expert gets tokens·top_k·ep/num_experts rows
        n_local = -(-shape.num_experts // ep)
        me, fe = T * shape.top_k * ep / shape.num_experts, a.expert_dim / t
        for sh in [(me, fe, d), (me, fe, d), (me, d, fe)]:
            x, y = gemm3(*sh)
            g_f, g_b = g_f + moe_frac * n_local * x, g_b + moe_frac * n_local * y
        for sh in [(T, d, a.num_experts)] + [(T, fe * shape.shared_experts, d)] * 2 \
                + [(T, d, fe * shape.shared_experts)] * (1 if shape.shared_experts else 0):
            x, y = gemm3(*sh)
            g_f, g_b = g_f + moe_frac * x, g_b + moe_frac * y
    # attention core: T local queries against all seq_len keys, in ring steps of seq_len/cp keys; causal
    heads = a.n_heads // t
    chunk = seq_len / cp
    full_flops = 4.0 * T * seq_len * a.head_dim * heads  # QK^T and PV over every key, forward
    bw = rates.ew_bytes_s if rates is not None else gpu.hbm_bw * gpu.hbm_eff
    if flash and rates is not None:  # the fitted rate holds the kernel's forward : backward mix
        a_f = full_flops / 2 / rates.attn_flops_s
        a_b = 2.5 * a_f
    elif flash:
        arch = gpu.arch
        frac = attention_fraction(kernel, a.head_dim, int(chunk), True, arch)
        a_f = full_flops / 2 / (peak * frac)
        a_b = 2.5 * full_flops / 2 / (peak * frac * BWD_RATIO[kernel if arch == "hopper" else "fa2"])
    else:  # unfused: two batched GEMMs over the full S×S (masked, not skipped) + softmax traffic
        seqs = T / seq_len
        bmm = seqs * heads * gemm(seq_len, seq_len, a.head_dim)
        scores = seqs * heads * seq_len * seq_len * e / bw
        a_f = 2 * bmm + 2 * scores        # fused scale-mask-softmax reads and writes the scores
        a_b = 4 * bmm + 3 * scores        # its backward reads probabilities and their gradient
        if attn_dropout:  # dropout on the probabilities (meshlm has none; Megatron-LM 2021 used 0.1):
            a_f += (2 + 1 / e) * scores   # read and write them, write a one-byte mask
            a_b += (2 + 1 / e) * scores   # and in backward the gradient, reading the mask
    ew_f, ew_b, k_f, k_b = elementwise(a, t, sp, compiled, e)
    cpu = rates is not None
    if cpu:
        launch = rates.dispatch_s
    x_f, l_f = _parts(T * ew_f / bw, k_f, launch, cpu)  # GEMM launches overlap their own math: not counted
    x_b, l_b = _parts(T * ew_b / bw, k_b, launch, cpu)
    e_f, e_b = x_f + l_f, x_b + l_b
    # weight gradients accumulate into the fp32 gradient buffer every micro-batch: read e, read-write 4·2
    params = (2 * q + 2 * kv) * d + 3 * d * f
    acc = params * (e + 8) / bw
    block_f = g_f + a_f + e_f
    block_b = g_b + a_b + e_b + acc
    t_f, t_b = layers * block_f, layers * block_b
    # element-wise work and its launches apart (`launch_s`: kernels × launch where that is longer on a
    # GPU, every dispatch on a CPU); the loss's launches are in launch_s too
    out = {"gemm_s": layers * (g_f + g_b), "attention_s": layers * (a_f + a_b),
           "elementwise_s": layers * (x_f + x_b), "launch_s": layers * (l_f + l_b), "grad_accum_s": layers * acc,
           "head_s": 0.0, "loss_s": 0.0}
    if head:
        rows = vocab_rows(a, t)
        hf, hb = gemm3(T, rows, d)
        lb, lk = _loss(e, compiled and t == 1)
        lx, ll = _parts(T * rows * lb / bw, lk, launch, cpu)
        loss = lx + ll
        out["head_s"], out["loss_s"] = hf + hb, lx
        out["launch_s"] += ll
        t_f += hf + loss / 3
        t_b += hb + 2 * loss / 3
    if ac == "full":
        t_rc = layers * block_f
    elif ac == "selective":
        t_rc = layers * a_f
    elif ac == "op":  # matmul and attention outputs kept: the element-wise forward runs again (and
        t_rc = layers * (e_f + g_rc)  # the matmuls a policy does not keep: Options.recompute_gemms)
    else:
        t_rc = 0.0
    out["recompute_s"] = t_rc
    attn = layers * (a_f + a_b + (a_f if ac in ("full", "selective") else 0.0))
    return {"t_f": t_f, "t_b": t_b, "t_rc": t_rc, "t_attn": attn, "ops": out}
