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
each number comes from. The one number read off validation rows, DENSE_MASK_FRACTION, names them, and
tests/test_plan_validation.py marks them as fed; every other row is held out.
"""
from __future__ import annotations

import math
from bisect import bisect_left
import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from ...core.choices import HELD
from ..hardware import GPU
from .activations import vocab_rows
from .attn_widths import attn_widths

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
    """One rank's rates fitted from a profiled run (plan/calibrate/fit.py), replacing the GPU tables: the
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


@lru_cache(maxsize=65536)
def wave_efficiency(m: float, n: float, sms: int, k: float = 0.0) -> float:
    """Busy fraction of the SMs over the GEMM's waves of output tiles (NVIDIA's wave quantization).
    With fewer tiles than SMs (a weight gradient: small m×n, long k) cuBLAS splits k across SMs
    (split-K / Stream-K, Osama et al. 2023): the units of work become tiles × k-slices of 64, split
    evenly, so only the last partial wave of those is lost."""
    tiles = min(math.ceil(m / TILE[0]) * math.ceil(n / TILE[1]), math.ceil(m / TILE[1]) * math.ceil(n / TILE[0]))
    if tiles < sms and k > 0:
        tiles *= min(math.ceil(k / 64), math.ceil(sms / tiles))
    return min(1.0, tiles / (math.ceil(tiles / sms) * sms))


@lru_cache(maxsize=1 << 18)
def gemm_seconds(m: float, n: float, k: float, gpu: GPU, e: int, peak: float) -> float:
    """One (m×k)·(k×n) GEMM: compute at the GPU's measured large-GEMM ceiling (divided by that
    measurement's own wave efficiency, 8192³) times this shape's wave efficiency, or HBM traffic.
    Cached: the search prices the same block shapes for many layouts."""
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


def elementwise(a, t: int, sp: bool, compiled: bool, e: int, ffn: float | None = None,
                permute: float = 0.0) -> tuple[float, float, float, float]:
    """(forward bytes, backward bytes, forward kernels, backward kernels) per token of one block.
    `ffn`: the SwiGLU width a token passes through on this rank (default the dense ffn_dim / t; an
    MoE block's is its top_k and shared experts' widths); `permute`: an MoE block's routed copies of
    the token (top_k), each gathered to its expert and scattered back (d read and written, forward
    and again in backward)."""
    ops = _compiled(e) if compiled else _eager(e)
    d_norm = a.dim / t if sp and t > 1 else a.dim  # SP norms run on the token shard: d/t per token
    w = attn_widths(a, t)
    f = a.ffn_dim / t if ffn is None else ffn
    moe = 4 * e * a.dim * permute
    n_lat = 2 if w.latent_norms else 0  # MLA's q and kv latent norms (replicated: whole widths)
    fwd = 2 * ops["norm_f"][0] * d_norm + ops["rope_f"][0] * w.rope + ops["copy"][0] * w.out \
        + 2 * ops["add"][0] * d_norm + ops["swiglu_f"][0] * f + moe + ops["norm_f"][0] * w.latent_norms
    bwd = 2 * ops["norm_b"][0] * d_norm + ops["rope_b"][0] * w.rope + ops["copy"][0] * w.out \
        + 2 * ops["add"][0] * d_norm + ops["swiglu_b"][0] * f + moe + ops["norm_b"][0] * w.latent_norms
    kf = (2 + n_lat) * ops["norm_f"][1] + 2 * ops["rope_f"][1] + ops["copy"][1] + 2 * ops["add"][1] + ops["swiglu_f"][1]
    kb = (2 + n_lat) * ops["norm_b"][1] + 2 * ops["rope_b"][1] + ops["copy"][1] + 2 * ops["add"][1] + ops["swiglu_b"][1]
    return fwd, bwd, kf, kb


def _parts(seconds: float, kernels: float, launch: float, cpu: bool) -> tuple[float, float]:
    """(data seconds, launch seconds) of a group of kernels. On a GPU the group takes its device time or
    its host dispatches, whichever is longer: launches count only where they exceed the kernels. On a
    CPU the core that dispatches an op also runs it: the two add up."""
    return (seconds, kernels * launch) if cpu else (seconds, max(0.0, kernels * launch - seconds))


# ------------------------------------------------------------------ masked attention
# SDPA with a dense [B, 1, S, S] boolean mask (data.document_mask under attn_impl = "sdpa") leaves the
# cuDNN flash kernels for the memory-efficient one, which computes every query-key pair (a mask skips
# nothing). Its rate, as a fraction of the dense bf16 peak over forward and backward FLOPs (the full
# S×S, backward 2.5x), is read off two runs of the shared H100 (shared/gpu/h100-2026-11-25, llama3-1b,
# mb 16, selective AC, compiled): the masked run's step is 93.5 ms longer than the unmasked one's
# (0.5941 s against 0.5006 s), on top of the 67.1 ms the profiled unmasked step spent in its cuDNN
# attention kernels; 16 blocks × 5.5e11 FLOPs × (2 forwards + 2.5) in 160.6 ms is 0.249 of 989 TFLOP/s.
# Rows that fed it: "meshlm llama3-1b docmask" (tests/test_plan_validation.py marks it).
DENSE_MASK_FRACTION = 0.249
# attn_mask values under which SDPA is handed a boolean mask: a document mask ([B, 1, S, S], or under
# all-gather CP this rank's rows of it) and all-gather CP's causal rows ([S/cp, S], shared by the batch)
DENSE_MASKS = ("dense", "rows")
FLEX_BLOCK = 128  # the BlockMask block meshlm builds (model.flex.BLOCK: FlexAttention's default, 128)


@lru_cache(maxsize=1024)
def causal_blocks(seq: int, doc_tokens: int = 0, block: int = FLEX_BLOCK) -> int:
    """Query×key blocks a block-sparse kernel computes for causal attention over `seq` tokens packed
    with documents of `doc_tokens` each (0: one document): the diagonal and every block below it that
    holds a same-document pair."""
    n = -(-seq // block)
    if doc_tokens <= 0 or doc_tokens >= seq:
        return n * (n + 1) // 2
    return sum(i - (i * block // doc_tokens) * doc_tokens // block + 1 for i in range(n))


def attention_seconds(w: "StageWork", gpu: GPU, peak: float, full_flops: float, chunk: float,
                      rates: "Rates | None") -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention core; `full_flops`: QKᵀ and PV over every
    query-key pair, forward."""
    a = w.shape.args
    if rates is not None:  # a calibrated CPU: the fitted rate holds the kernel's forward : backward mix
        return full_flops / 2 / rates.attn_flops_s, 2.5 * full_flops / 2 / rates.attn_flops_s
    arch = gpu.arch
    if w.attn_mask in DENSE_MASKS:
        rate = peak * DENSE_MASK_FRACTION * gpu.attn_scale
        return full_flops / rate, 2.5 * full_flops / rate
    kernel = "fa2" if w.attn_mask == "flex" or arch != "hopper" else w.kernel
    # flex: a Triton kernel of FlashAttention-2's structure, priced at FA2's rate (no flex measurement
    # here), over the blocks its BlockMask keeps (the causal kernel's share of them). One call spans
    # the whole sequence's keys (all-gather CP: this rank's zig-zag rows, balanced, so its share of
    # the kept blocks is the sequence's over cp)
    if w.attn_mask == "flex":
        chunk = w.seq_len
    kept = causal_blocks(int(chunk), w.doc_tokens) / causal_blocks(int(chunk)) if w.attn_mask == "flex" else 1.0
    frac = attention_fraction(kernel, attn_widths(a, w.tp).qk, int(chunk), True, arch) * gpu.attn_scale
    a_f = kept * full_flops / 2 / (peak * frac)
    return a_f, 2.5 * a_f / BWD_RATIO[kernel]


# ------------------------------------------------------------------ one stage's micro-batch

@dataclass(frozen=True)
class StageWork:
    """What one micro-batch computes on one rank of a stage: the model, its local share (tp, ep, cp,
    sp, the stage's blocks and whether it holds the head) and how the code runs it."""
    shape: object                 # spec.Shape
    tp: int
    sp: bool
    ep: int
    seq_len: int
    cp: int
    layers: int
    head: bool
    tokens: float                 # local tokens of the micro-batch
    ac: str
    precision: str
    compiled: bool
    flash: bool = True
    kernel: str = "cudnn"
    attn_dropout: bool = False
    recompute_gemms: tuple = ()   # estimate.Options.recompute_gemms
    attn_mask: str = "causal"     # causal | dense (SDPA with a document mask) | rows (all-gather CP's
    #                               causal rows, a dense mask shared by the batch) | flex (a BlockMask)
    doc_tokens: int = 0           # mean document length the flex BlockMask skips by (0: unknown)
    loss_chunks: int = 0          # training.loss_chunks: the head and loss run over this many chunks


# torchao float8 training (tensorwise scales) casts per linear and micro-batch: its input (amax read,
# cast: e read, 1 written) forward, the output gradient likewise in backward, and the weight (2-byte
# compute copy: amax read, cast read, 1 written) once each way (torchao float8/float8_linear.py)
def _fp8_cast_bytes(e: int) -> float:
    return 2 * e + 1


@lru_cache(maxsize=65536)
def stage_compute(w: StageWork, gpu: GPU, rates: Rates | None = None) -> dict:
    """Seconds of one micro-batch on one rank of a stage: forward, backward, recompute and the
    attention kernels alone (the window ring-CP transfers hide behind), plus the per-op breakdown.
    A stage is `layers` times one block (`block_compute`, the same for every stage length and AC mode)
    plus the head."""
    one = w if (w.layers, w.ac) == (1, "none") else dataclasses.replace(w, layers=1, ac="none")
    return stage_of_blocks(block_compute(one, gpu, rates), w.layers, w.head, w.ac)


def stage_of_blocks(parts: tuple, layers: int, head: bool, ac: str) -> dict:
    """stage_compute's answer for `layers` blocks (`block_compute`'s `parts`) under AC mode `ac`."""
    g_f, g_b, a_f, a_b, x_f, x_b, l_f, l_b, e_f, block_f, block_b, g_rc, head_parts = parts
    t_f, t_b, t_rc = stage_times(parts, layers, head, ac)
    # element-wise work and its launches apart (`launch_s`: kernels × launch where that is longer on a
    # GPU, every dispatch on a CPU); the loss's launches are in launch_s too
    out = {"gemm_s": layers * (g_f + g_b), "attention_s": layers * (a_f + a_b),
           "elementwise_s": layers * (x_f + x_b), "launch_s": layers * (l_f + l_b), "grad_accum_s": 0.0,
           "head_s": 0.0, "loss_s": 0.0}
    if head:
        hf, hb, lx, ll = head_parts
        out["head_s"], out["loss_s"] = hf + hb, lx
        out["launch_s"] += ll
    out["recompute_s"] = t_rc
    attn = layers * (a_f + a_b + (a_f if ac in ("full", "selective") else 0.0))
    return {"t_f": t_f, "t_b": t_b, "t_rc": t_rc, "t_attn": attn, "ops": out}


def stage_times(parts: tuple, layers: int, head: bool, ac: str) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of `layers` blocks (`block_compute`'s `parts`) and the head.
    Recompute: full AC runs each block's forward again, selective the attention core, op the element-wise
    forward (matmul and attention outputs kept) and the matmuls a policy does not keep (recompute_gemms)."""
    _, _, a_f, _, _, _, _, _, e_f, block_f, block_b, g_rc, head_parts = parts
    t_f, t_b = layers * block_f, layers * block_b
    if head:
        hf, hb, lx, ll = head_parts
        loss = lx + ll
        t_f += hf + loss / 3
        t_b += hb + 2 * loss / 3
    per_block = {"full": block_f, "selective": a_f, "op": e_f + g_rc}.get(ac)
    return t_f, t_b, layers * per_block if per_block is not None else 0.0


@lru_cache(maxsize=16384)
def block_compute(w: StageWork, gpu: GPU, rates: Rates | None) -> tuple:
    """One block's seconds of `w` (its `layers` 1, its `ac` "none") in parts: GEMMs, attention core, element-wise
    data and launches (forward, backward), the forward's element-wise total, the block's forward and
    backward, the GEMMs another framework recomputes, and (head, head backward, loss data, loss
    launches) when `w.head`, else None. Cached apart from the stage's length and AC mode: the search
    prices every split and AC mode of the same block."""
    a, t = w.shape.args, w.tp
    fp8 = w.precision == "fp8" and rates is None
    e = HELD[w.precision].act
    peak = gpu.peak(w.precision)
    launch = gpu.launch_compiled_s if w.compiled else gpu.launch_eager_s
    aw = attn_widths(a, t)
    ffn, d = a.ffn_dim / t, a.dim
    moe_frac = a.n_moe_blocks / a.n_layers if w.shape.moe else 0.0

    def gemm(m, n, k, block: bool = False):
        if rates is not None:
            return 2.0 * m * n * k / rates.gemm_flops_s if m > 0 and n > 0 and k > 0 else 0.0
        return gemm_seconds(m, n, k, gpu, e, peak * (gpu.fp8_gemm_speedup if block and fp8 else 1.0))

    def gemm3(m, n, k, block: bool = True):  # forward, and backward's input-gradient and weight-gradient GEMMs
        return gemm(m, n, k, block), gemm(m, k, n, block) + gemm(k, n, m, block)

    g_f, g_b, g_rc, expert_ffn = _block_gemms(w, gemm3, aw.gemms, ffn, moe_frac)
    bw = rates.ew_bytes_s if rates is not None else gpu.hbm_bw * gpu.hbm_eff
    a_f, a_b = _attention_core(w, gpu, peak, e, bw, gemm, rates)
    ew_f, ew_b, k_f, k_b = elementwise(a, t, w.sp, w.compiled, e,
                                       (1 - moe_frac) * ffn + moe_frac * expert_ffn, moe_frac * w.shape.top_k)
    if fp8:  # the linears' inputs (forward) and output gradients (backward) per token are cast
        cast = _fp8_cast_bytes(e)
        lin_in = sum(k for _, _, k in aw.gemms) + (1 - moe_frac) * (2 * d + ffn)
        lin_out = sum(n for _, n, _ in aw.gemms) + (1 - moe_frac) * (2 * ffn + d)
        ew_f, ew_b = ew_f + cast * lin_in, ew_b + cast * lin_out
    cpu = rates is not None
    if cpu:
        launch = rates.dispatch_s
    x_f, l_f = _parts(w.tokens * ew_f / bw, k_f, launch, cpu)  # GEMM launches overlap their own math: not counted
    x_b, l_b = _parts(w.tokens * ew_b / bw, k_b, launch, cpu)
    if fp8:  # every block weight cast to fp8 once forward, once backward (its transpose)
        wcast = 2 * (2 + 2 + 1) * (sum(n * k for _, n, k in aw.gemms) + (1 - moe_frac) * 3 * d * ffn) / bw
        x_f, x_b = x_f + wcast / 2, x_b + wcast / 2
    e_f, e_b = x_f + l_f, x_b + l_b
    head = _head_and_loss(w, gemm3, e, bw, launch, cpu) if w.head else None
    return g_f, g_b, a_f, a_b, x_f, x_b, l_f, l_b, e_f, g_f + a_f + e_f, g_b + a_b + e_b, g_rc, head


def _block_gemms(w: StageWork, gemm3, attn_gemms: tuple, ffn: float,
                 moe_frac: float) -> tuple[float, float, float, float]:
    """(forward, backward, recomputed under another framework's op policy) GEMM seconds of one block,
    and the expert FFN width per token its element-wise work runs over. MoE blocks (a `moe_frac` of
    them) replace the dense FFN with routed experts, the router and the shared experts."""
    shape, a, T, d = w.shape, w.shape.args, w.tokens, w.shape.args.dim
    attn_shapes = [(name, T, n, k) for name, n, k in attn_gemms]  # attn_widths: GQA's or MLA's projections
    dense_ffn = [("w1", T, ffn, d), ("w3", T, ffn, d), ("w2", T, d, ffn)]
    g_f = g_b = g_rc = 0.0
    for weight, group in ((1.0, attn_shapes), (1.0 - moe_frac, dense_ffn)):
        for name, *sh in group:
            x, y = gemm3(*sh)
            g_f, g_b = g_f + weight * x, g_b + weight * y
            g_rc += weight * x if name in w.recompute_gemms else 0.0
    if not moe_frac:
        return g_f, g_b, g_rc, 0.0
    # balanced routing: each local expert gets tokens·top_k·ep/num_experts rows
    n_local = -(-shape.num_experts // w.ep)
    me, fe = T * shape.top_k * w.ep / shape.num_experts, a.expert_dim / w.tp
    for sh in [(me, fe, d), (me, fe, d), (me, d, fe)]:
        x, y = gemm3(*sh)
        g_f, g_b = g_f + moe_frac * n_local * x, g_b + moe_frac * n_local * y
    for sh in [(T, d, a.num_experts)] + [(T, fe * shape.shared_experts, d)] * 2 \
            + [(T, d, fe * shape.shared_experts)] * (1 if shape.shared_experts else 0):
        x, y = gemm3(*sh)
        g_f, g_b = g_f + moe_frac * x, g_b + moe_frac * y
    return g_f, g_b, g_rc, (shape.top_k + shape.shared_experts) * fe


def _attention_core(w: StageWork, gpu: GPU, peak: float, e: int, bw: float, gemm,
                    rates: Rates | None) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention core: T local queries against all seq_len
    keys, in ring steps of seq_len/cp keys; causal."""
    aw = attn_widths(w.shape.args, w.tp)
    heads = aw.heads
    # QK^T (q/k head size) and PV (value head size) over every key, forward
    full_flops = 2.0 * w.tokens * w.seq_len * (aw.qk + aw.v_head) * heads
    if w.flash or w.attn_mask != "causal":
        return attention_seconds(w, gpu, peak, full_flops, w.seq_len / w.cp, rates)
    # unfused: two batched GEMMs over the full S×S (masked, not skipped) + softmax traffic
    seqs = w.tokens / w.seq_len
    bmm = seqs * heads * (gemm(w.seq_len, w.seq_len, aw.qk) + gemm(w.seq_len, w.seq_len, aw.v_head))
    scores = seqs * heads * w.seq_len * w.seq_len * e / bw
    a_f = bmm + 2 * scores            # fused scale-mask-softmax reads and writes the scores
    a_b = 2 * bmm + 3 * scores        # its backward reads probabilities and their gradient
    if w.attn_dropout:  # dropout on the probabilities (meshlm has none; Megatron-LM 2021 used 0.1):
        a_f += (2 + 1 / e) * scores   # read and write them, write a one-byte mask
        a_b += (2 + 1 / e) * scores   # and in backward the gradient, reading the mask
    return a_f, a_b


def _head_and_loss(w: StageWork, gemm3, e: int, bw: float, launch: float,
                   cpu: bool) -> tuple[float, float, float, float]:
    """(head forward, head backward, loss element-wise, loss launches) seconds of one micro-batch. The
    output head stays bf16 under fp8 (torchao's filter); a chunked loss makes a chunk's logits again in
    backward, so the head's forward runs twice. Each MTP module (its block is one of the stage's
    `layers`) adds its projection from [embedding; hidden] (2d → d) and runs the head and loss again."""
    a, t, T = w.shape.args, w.tp, w.tokens
    rows, heads = vocab_rows(a, t), 1 + a.mtp_depth
    hf, hb = gemm3(T, rows, a.dim, block=False)
    if w.loss_chunks > 0:
        hb += hf
    hf, hb = heads * hf, heads * hb
    if a.mtp_depth:
        pf, pb = gemm3(T, a.dim, 2 * a.dim, block=False)
        hf, hb = hf + a.mtp_depth * pf, hb + a.mtp_depth * pb
    lb, lk = _loss(e, w.compiled and t == 1)
    lx, ll = _parts(heads * T * rows * lb / bw, heads * lk * max(1, w.loss_chunks), launch, cpu)
    return hf, hb, lx, ll
