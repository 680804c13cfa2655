"""The planner's validation table (docs/planner.md, "Validation"): predictions of the per-operation
time model against published and measured runs. Every row is held to 10% in tokens/s per GPU or 4
MFU points, and no prediction may be optimistic by more than 10%. A row that still misses is an
xfail (strict) that says why; no row has a wider range of its own.

Every row sets seq_len explicitly and depends on no preset's max_seq_len. Measured values are copied
from their sources (named per row). `FED` names the rows that a constant of plan/ was read off (with
the constant); every other row is held out, and held-out and fed rows are asserted alike.
"""
from __future__ import annotations

import dataclasses

import pytest

from meshlm.core.model_args import PRESETS, ModelArgs
from meshlm.plan.cost.estimate import Options, estimate
from meshlm.plan.hardware import get_gpu
from meshlm.plan.cost.ops import gemm_seconds
from meshlm.plan.search.ranked import plan
from meshlm.plan.spec import Shape, Spec

H100 = get_gpu("h100")
TOL, TOL_MFU = 0.10, 0.04
SHARED = "shared/gpu/h100-2026-11-25"


def _preset(name: str, **changes) -> Shape:
    return Shape(dataclasses.replace(PRESETS[name], **changes) if changes else PRESETS[name], name)


def _tok_from_mfu(shape: Shape, seq: int, mfu: float, peak: float) -> float:
    """Tokens/s per GPU that an MFU implies under meshlm's FLOPs per token (6N + 12·L·d·S)."""
    return mfu * peak / shape.flops_per_token(seq)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    shape: Shape
    spec: Spec
    gpu: object
    options: Options
    measured: float          # tokens/s per GPU
    source: str
    miss: str = ""           # why the row still misses (it is then an xfail); "" = held to the tolerance
    mfu_peak: float = 989e12  # the peak its MFU points are read against (the datasheet's)


# constant of plan/ -> the rows it was read off (docs/planner.md says how); every other row is held out
FED = {
    "estimate.STEP_GAP_S, OPT_KERNEL_BYTES, GRAD_ACCUM_BYTES (the profiled step's kernels)":
        ("meshlm llama3-1b mb16 selective (meshlm train CLI, profiled)",),
    "ops.DENSE_MASK_FRACTION (the masked step less the unmasked one)":
        ("meshlm llama3-1b mb16 selective docmask (dense-mask SDPA)", "meshlm llama3-1b mb16 selective"),
}


def _shared_h100():
    """shared/gpu/h100-2026-11-25/README.md: one H100 80GB SXM, seq 2048 unless noted, compiled, bf16
    params and compute with fp32 masters, fused AdamW; SDPA ran cuDNN (the mask: memory-efficient)."""
    c = Options(compiled=True)
    return [
        Row("meshlm llama3-1b mb16 selective", _preset("llama3-1b"), Spec(micro_batch=16, ac="selective"), H100, c,
            65454, f"{SHARED} bench-llama3-1b-selective.json"),
        Row("meshlm llama3-1b mb16 none", _preset("llama3-1b"), Spec(micro_batch=16, ac="none"), H100, c, 67011,
            f"{SHARED} bench-llama3-1b-noac.json"),
        # the median of steps 3-10 less the profiled 8 (64,450-67,433 logged)
        Row("meshlm llama3-1b mb16 selective (meshlm train CLI, profiled)", _preset("llama3-1b"),
            Spec(micro_batch=16, ac="selective"), H100, c, 65160, f"{SHARED} run-llama3-1b/metrics.jsonl"),
        Row("meshlm llama3-1b mb4 none seq 8192", _preset("llama3-1b"), Spec(micro_batch=4, ac="none", seq_len=8192),
            H100, c, 55740, f"{SHARED} bench-llama3-1b-seq8192.json"),
        Row("meshlm llama3-1b mb16 selective docmask (dense-mask SDPA)", _preset("llama3-1b"),
            Spec(micro_batch=16, ac="selective"), H100, dataclasses.replace(c, attn_mask="dense"), 55157,
            f"{SHARED} bench-llama3-1b-docmask.json"),
        Row("meshlm llama3-3b mb4 selective", _preset("llama3-3b"), Spec(micro_batch=4, ac="selective"), H100, c,
            22591, f"{SHARED} bench-llama3-3b.json"),
        Row("meshlm deepseek-moe-16b 4 blocks mb8 selective", _preset("deepseek-moe-16b", n_layers=4),
            Spec(micro_batch=8, ac="selective"), H100, c, 98468, f"{SHARED} bench-deepseek-moe-4blocks.json"),
    ]


def _benchmarks_md():
    """docs/benchmarks.md "GPU (bench/gpu_session.sh, bench/results/)": one H100 80GB SXM, seq 2048, bf16, SDPA picked cuDNN."""
    return [Row("meshlm llama3-1b mb8 selective eager", _preset("llama3-1b"), Spec(micro_batch=8, ac="selective"),
                H100, Options(compiled=False), 43066, "docs/benchmarks.md"),
            # small (dim 256): 23.9% MFU measured; the model's GEMMs are HBM-bound at this width
            Row("meshlm small mb64 none compiled", _preset("small"), Spec(micro_batch=64, ac="none"), H100,
                Options(compiled=True), 3218404, "docs/benchmarks.md")]


# torchtitan's selective AC "op" (torchtitan/models/llama/parallelize_llama.py, _apply_ac_to_transformer_block):
# the outputs of aten.mm and SDPA are saved "except every second mm", everything else is recomputed. Per
# block the forward runs wq wk wv (Attention.forward), wo, then w1 w3 w2 (FeedForward: w2(silu(w1(x)) *
# w3(x))), so the 2nd, 4th and 6th matmuls (wk, wo, w3) and every element-wise op run again; attention
# does not. meshlm's "selective" (the attention core again) is a different policy.
TORCHTITAN_OP_AC = ("wk", "wo", "w3")


# measured fp8 saving per step (Table 1: 16,384 / 6,667 - 16,384 / 8,532 tokens/s = 0.537 s; Table 3:
# 0.560 s) against the model's 0.203 s: with the fp8 GEMM speedups ceilings.json measured (1.58-1.81x)
# and casts at most as priced, that run's bf16 block GEMMs took 1.2-2.0 s where the 500 W profile
# prices 1.12 s, so part of every bf16 miss is the GEMM rate a 500 W limit leaves (docs/planner.md)
_TT_GEMM = ("the bf16 GEMM rate at 500 W: the measured fp8 saving (0.54 s a step against the modelled "
            "0.20 s) puts the run's bf16 block GEMMs at 1.2-2.0 s where the profile (886 TFLOP/s, a "
            "datasheet interpolation) prices 1.12 s, and no GPU here runs at that power limit; the same pricing "
            "of torchtitan's code is within 2% on A100 (the torchtitan A100 rows)")
_TT_EAGER = ("0.28 s of their 2.84 s step is unpriced: " + _TT_GEMM + "; and their eager element-wise "
             "kernels are not meshlm's (FSDP2's overlapped collectives slow the compute beside them, priced "
             "since the H200 measurement of GPU.overlap_slowdown: 1.3 points of the miss)")
_TT_COMPILED = ("the eager row's unpriced 0.28 s added here leaves +8.8%; the rest is compile credited with "
                "0.58 s (element-wise, loss, recompute fused) where torchtitan's per-block compile gained 0.39 s "
                "(1.16x measured, 1.30x modelled); and " + _TT_GEMM)


def _torchtitan():
    """torchtitan docs/performance.md (torch of 2024-12-23, torchtitan 9dec370) Tables 1 and 3: Llama
    3.1 8B, FSDP over 8 and 128 H100 96GB HBM2e at 500 W (the profile of that power limit, hardware.py),
    seq 8192, local batch 2, selective (op) AC, bf16, and Float8 (torchao tensorwise, the output layer
    left bf16: meshlm's fp8 pricing); TPS/GPU read at step 90 over 10 steps; torch's SDPA of Dec. 2024
    ran FlashAttention-2. The host gap per step is meshlm's, not theirs: none is priced."""
    g = get_gpu("h100-500w")
    o = Options(attn_kernel="fa2", recompute_gemms=TORCHTITAN_OP_AC, step_overhead_s=0.0)
    rows = []
    for gpus, table, (eager, comp, fp8), misses in [
            (8, 1, (5762, 6667, 8532), ("optimistic by 10%: " + _TT_EAGER, "optimistic by 23%: " + _TT_COMPILED,
                                        "")),
            # the float8 row at 128 GPUs: +10.9% until the wait for the slowest of 128 ranks and the ring
            # depth of the 128-rank gathers were priced (plan/cost/scale.py), +10.0% since: held, at the edge
            (128, 3, (5605, 6514, 8380), ("optimistic by 14%: " + _TT_EAGER, "optimistic by 27%: " + _TT_COMPILED,
                                          ""))]:
        spec = Spec(dp=gpus, zero=3, zero_group=gpus, micro_batch=2, ac="op", seq_len=8192)
        src = f"torchtitan docs/performance.md Table {table}"
        rows += [Row(f"torchtitan llama3-8b FSDP{gpus} eager", _preset("llama3-8b"), spec, g,
                     dataclasses.replace(o, compiled=False), eager, src, miss=misses[0]),
                 Row(f"torchtitan llama3-8b FSDP{gpus} compiled", _preset("llama3-8b"), spec, g,
                     dataclasses.replace(o, compiled=True), comp, src, miss=misses[1]),
                 Row(f"torchtitan llama3-8b FSDP{gpus} compiled float8", _preset("llama3-8b"),
                     dataclasses.replace(spec, precision="fp8"), g, dataclasses.replace(o, compiled=True), fp8, src,
                     miss=misses[2])]
    return rows


def _llama2_shape(dim: int, layers: int, heads: int, kv: int, ffn: int) -> Shape:
    """Llama 2 (Touvron et al. 2023): vocabulary 32,000, context 4096."""
    return Shape(ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, vocab_size=32000,
                           max_seq_len=4096), f"llama2-{dim}")


def _torchtitan_a100():
    """The A100 version of torchtitan's docs/performance.md (torchtitan commit 0413364): FSDP2 over 64
    A100 80GB, bf16, Llama 3 at seq 8192 and Llama 2 at 4096, eager (the doc names no compile: torchtitan's
    default then), its "selective op" AC priced as above; SDPA's flash kernel (FlashAttention-2, the one
    sm80 has). Its "selective layer" rows (every second block recomputed whole) are left out: meshlm has
    no such policy to price. These rows test the A100 profile, whose GEMM ceiling is the H100's measured
    fraction (hardware.py), on 2024 software."""
    g = get_gpu("a100-80gb")
    src = "torchtitan docs/performance.md (A100, commit 0413364)"
    o = Options(attn_kernel="fa2", compiled=False, step_overhead_s=0.0)
    rows = []
    for name, shape, seq, mb, ac, measured, miss in [
            ("llama3-8b bs1 selective op", _preset("llama3-8b"), 8192, 1, "op", 2973, ""),
            ("llama3-70b bs1 full", _preset("llama3-70b"), 8192, 1, "full", 331, ""),
            ("llama2-13b bs2 no AC", _llama2_shape(5120, 40, 40, 40, 13824), 4096, 2, "none", 2162, ""),
            ("llama2-13b bs2 selective op", _llama2_shape(5120, 40, 40, 40, 13824), 4096, 2, "op", 1904, ""),
            # +13.5% until the overlap slowdown was priced: the same FSDP traffic per step over half the
            # tokens of the batch-2 row, so twice the collective time per token beside the compute
            ("llama2-70b bs1 selective op", _llama2_shape(8192, 80, 64, 8, 28672), 4096, 1, "op", 355, ""),
            ("llama2-70b bs2 full", _llama2_shape(8192, 80, 64, 8, 28672), 4096, 2, "full", 353, "")]:
        spec = Spec(dp=64, zero=3, zero_group=64, micro_batch=mb, ac=ac, seq_len=seq)
        rows.append(Row(f"torchtitan {name} FSDP64 A100", shape, spec, g,
                        dataclasses.replace(o, recompute_gemms=TORCHTITAN_OP_AC if ac == "op" else ()), measured, src,
                        miss=miss, mfu_peak=312e12))
    return rows


def _llama3_table4():
    """Llama 3 paper (Dubey et al. 2024) Table 4: 405B, TP 8 + SP, PP 16, 16M-token batches, H100 80GB;
    interleaved v 4, ZeRO-1 over DP, compiled, no AC (docs/planner.md reads the setup). Meta's host
    gap per step is not meshlm's: none is priced."""
    sh = _preset("llama3-405b")
    rows = []
    for gpus, dp, cp, seq, m, mfu, miss in [
            (8192, 64, 1, 8192, 32, 0.43, "optimistic by 11% (47.7% MFU against 43%; 48.6% before the wait "
             "for the slowest of 8,192 ranks and the ring/tree depth of the collectives were priced from our own "
             "measurements: 0.03 s and 0.17 s of an 11.4 s step, docs/planner.md 'What grows with the number "
             "of ranks'): Meta's layout at dp 64 (32 micro-batches) "
             "does not fit 80 GB under meshlm's memory model (tests/test_plan_pipeline.py), so the run cannot "
             "have been the priced layout and what it did instead (recompute, a lighter schedule) is not "
             "known; the attention kernel is not known either (cuDNN priced; FlashAttention-2, the one public "
             "before FA3's July 2024 release, gives +10.1%)"),
            (16384, 128, 1, 8192, 16, 0.41, ""),
            (16384, 8, 16, 131072, 16, 0.38, "optimistic by 33% against the MFU read with causal attention "
             "counted in full (meshlm's 6N + 12·L·d·S), priced with Meta's all-gather CP (exposed k,v "
             "gathers); attention is 57% of those FLOPs at 131K, so two unknowns decide the row: the "
             "paper's MFU formula (causal counted as half: the 38% is 92.9 tok/s, -2.1%) and Meta's "
             "attention kernel (cuDNN priced; FlashAttention-2: +6.3%)")]:
        s = Spec(dp=dp, tp=8, sp=True, pp=16, cp=cp, zero=1, zero_group=dp, pp_schedule="interleaved",
                 pp_virtual=4, micro_batch=1, accum=m, ac="none", precision="bf16", seq_len=seq,
                 cp_impl="allgather" if cp > 1 else "ring")  # Meta's CP (paper §3.3.2)
        assert s.world_size == gpus and s.global_batch * seq == 16 * 2 ** 20
        rows.append(Row(f"Llama 3 405B {gpus} GPUs cp{cp} seq {seq}", sh, s, H100,
                        # attn_impl None: Meta's own attention kernel, priced as a causal one (not meshlm's flex)
                        Options(compiled=True, step_overhead_s=0.0, attn_impl=None),
                        _tok_from_mfu(sh, seq, mfu, H100.peak_flops), "Llama 3 paper Table 4", miss))
    return rows


# Narayanan et al. 2021 (Megatron-LM, SC'21) Table 1: GPT, seq 2048, vocab 51200, A100 80GB (Selene),
# fp16, full recomputation; (name, heads, hidden, layers, tp, pp, gpus, global batch, TFLOP/s per GPU)
MEGATRON = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
            ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163)]
_A100 = ("the A100 profile is not what differs: it predicts torchtitan's 2024 FSDP2 runs on 64 A100s within "
         "-0.2% to +6.5% (the torchtitan A100 rows above, held out), although its GEMM ceiling is the H100's "
         "measured fraction; what differs is the 2020 software of these runs (NGC 20.12, CUDA 11.1's cuBLAS, "
         "Megatron's kernels of then), whose rates nothing here measures; the layout is not the difference: "
         "Megatron-LM's examples/sc21/run_table_1.sh ran these rows at micro-batch 16 / 8 with torch DDP "
         "(bucketed, overlapped with the backward, as priced), and at micro-batch 8 the 18.4B row is +11.7%")
MEGATRON_MISS = {"1.7B": "optimistic by 11%: " + _A100, "18.4B": "optimistic by 13%: " + _A100}


def _megatron_shape(heads: int, h: int, layers: int) -> Shape:
    """Their GPT block as a meshlm shape of the same parameters and FLOPs: SwiGLU with ffn 8h/3 (rounded
    to 64) for the 4h GeLU MLP, multi-head attention, tied embeddings."""
    f = -(-8 * h // 3 // 64) * 64
    return Shape(ModelArgs(dim=h, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=f, vocab_size=51200,
                           max_seq_len=2048, tie_embeddings=True), f"gpt-{h}")


def _megatron_tokens(h: int, layers: int, tflops: float, s: int = 2048, v: int = 51200) -> float:
    """Tokens/s per GPU from their TFLOP/s: their FLOPs per token 96·l·h²(1 + s/6h + V/16lh) (recompute
    counted, their eq. 3) divided by the sequence length."""
    return tflops * 1e12 / (96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))


def _megatron_predicted(name, heads, h, layers, tp, pp, gpus, batch) -> dict:
    """Micro-batch and chunks per rank are not in Table 1: the planner picks the fastest that fits with
    their TP / PP / DP, full recomputation, no ZeRO, the interleaved schedule (pp > 1), unfused
    attention with dropout 0.1 on the probabilities, and their fused kernels priced as compiled."""
    fixed = {"tp": tp, "pp": pp, "cp": 1, "dp": gpus // (tp * pp), "zero": 0, "ac": "full", "offload": "none",
             "sp": False}
    if pp > 1:
        fixed.update(pp_schedule="interleaved", micro_batch=1)
    res = plan(_megatron_shape(heads, h, layers), get_gpu("a100-80gb"), gpus, 2048, batch * 2048, "fp16", top=1,
               fixed=fixed, o=Options(compiled=True, flash=False, attn_dropout=True, step_overhead_s=0.0))
    assert res.ranked, res.reasons
    return res.ranked[0]


ROWS = _shared_h100() + _benchmarks_md() + _torchtitan() + _torchtitan_a100() + _llama3_table4()


def _params(rows):
    return [pytest.param(r, id=r.name, marks=[pytest.mark.xfail(strict=True, reason=r.miss)] if r.miss else [])
            for r in rows]


def _check(name: str, pred: float, meas: float, flops_per_token: float, peak: float) -> None:
    err = pred / meas - 1
    dmfu = (pred - meas) * flops_per_token / peak
    print(f"{name}: predicted {pred:,.1f} tok/s/GPU, measured {meas:,.1f} ({err:+.1%}, {100 * dmfu:+.1f} MFU points)")
    assert abs(err) <= TOL or abs(dmfu) <= TOL_MFU, f"{name}: {err:+.1%}, {100 * dmfu:+.1f} MFU points"
    assert err <= TOL, f"{name}: optimistic by {err:+.1%}"


@pytest.mark.parametrize("row", _params(ROWS))
def test_validation_row(row):
    est = estimate(row.shape, row.spec, row.gpu, row.options)
    _check(row.name, est["tokens_per_s_per_gpu"], row.measured, row.shape.flops_per_token(row.spec.seq_len),
           row.mfu_peak)


@pytest.mark.parametrize("row", [pytest.param(r, id=r[0], marks=[pytest.mark.xfail(strict=True, reason=MEGATRON_MISS[r[0]])]
                                              if r[0] in MEGATRON_MISS else []) for r in MEGATRON])
def test_validation_megatron(row):
    name, heads, h, layers, tp, pp, gpus, batch, tflops = row
    r = _megatron_predicted(name, heads, h, layers, tp, pp, gpus, batch)
    _check(f"Megatron {name}", r["tokens_per_s_per_gpu"], _megatron_tokens(h, layers, tflops),
           _megatron_shape(heads, h, layers).flops_per_token(2048), 312e12)


def test_fed_rows_are_in_the_table_and_the_rest_are_held_out():
    """Every row a constant was read off is a row of the table; the held-out rows are the others (and
    include rows of every source)."""
    names = {r.name for r in ROWS}
    fed = {n for rows in FED.values() for n in rows}
    assert fed <= names
    held_out = [r for r in ROWS if r.name not in fed]
    assert {r.source.split()[0] for r in held_out} >= {SHARED, "torchtitan", "Llama", "docs/benchmarks.md"}


def test_compile_and_size_move_the_prediction_as_measured():
    """Eager is slower than compiled (35.8% vs 55.6% measured), and a narrow model reaches a smaller
    fraction of peak than a wide one (small 23.9% vs llama3-1b 53.9%)."""
    s = Spec(micro_batch=8, ac="selective", seq_len=2048)
    eager = estimate(_preset("llama3-1b"), s, H100, Options(compiled=False))["mfu"]
    comp = estimate(_preset("llama3-1b"), s, H100, Options(compiled=True))["mfu"]
    assert comp - eager > 0.10
    small = estimate(_preset("small"), Spec(micro_batch=64, seq_len=2048), H100, Options(compiled=True))["mfu"]
    big = estimate(_preset("llama3-1b"), Spec(micro_batch=8, seq_len=2048), H100, Options(compiled=True))["mfu"]
    assert small < big / 1.5
    # the flat model (--efficiency) changes neither: the reason for the per-operation model
    flat = [estimate(_preset("llama3-1b"), s, H100, Options(compiled=c, efficiency=0.6))["mfu"] for c in (0, 1)]
    assert flat[0] == pytest.approx(flat[1])


def test_torchtitan_op_ac_recomputes_its_matmuls():
    """A policy that does not keep some matmul outputs (torchtitan's "op" AC) recomputes their forward
    GEMMs on top of the element-wise forward that meshlm's "op" reruns; attention is not recomputed."""
    sh, g = _preset("llama3-8b"), get_gpu("h100-96gb")
    spec = Spec(dp=8, zero=3, zero_group=8, micro_batch=2, ac="op", seq_len=8192)
    own, tt = (estimate(sh, spec, g, Options(recompute_gemms=r))["time"]["recompute_s"] for r in ((), TORCHTITAN_OP_AC))
    a, T, e = sh.args, 2 * 8192, 2
    kv = a.n_kv_heads * a.head_dim
    wk_wo_w3 = ((kv, a.dim), (a.dim, a.dim), (a.ffn_dim, a.dim))
    gemms = sum(gemm_seconds(T, n, k, g, e, g.peak("bf16")) for n, k in wk_wo_w3)
    assert tt - own == pytest.approx(a.n_layers * gemms, rel=1e-9)


def test_torchtitan_op_ac_keeps_no_output_of_the_matmuls_it_recomputes():
    """Its saved set per token and block is the block input, q, v, the attention output and its
    log-sum-exp, the w1 output and the w2 output: wk, wo and w3 are run again, so their outputs are
    not kept (meshlm's own "op" keeps them all). Held against the torchtitan A100 table's footnote:
    Llama 2 70B under this policy ran at batch 1 on 80 GB and ran out of memory at batch 2."""
    sh, g = _llama2_shape(8192, 80, 64, 8, 28672), get_gpu("a100-80gb")
    o = Options(attn_kernel="fa2", recompute_gemms=TORCHTITAN_OP_AC)
    est = {mb: estimate(sh, Spec(dp=64, zero=3, zero_group=64, micro_batch=mb, ac="op", seq_len=4096), g, o)
           for mb in (1, 2)}
    a, e = sh.args, 2
    kept = a.dim + a.dim + a.n_kv_heads * a.head_dim + a.dim + a.ffn_dim + a.dim  # x, q, v, out, w1, w2
    assert est[1]["memory_detail"]["block_activation_bytes"] == 4096 * (e * kept + 4 * a.n_heads)
    own = estimate(sh, Spec(dp=64, zero=3, zero_group=64, micro_batch=1, ac="op", seq_len=4096), g,
                   Options(attn_kernel="fa2"))
    assert own["memory_detail"]["block_activation_bytes"] - est[1]["memory_detail"]["block_activation_bytes"] \
        == 4096 * e * (a.n_kv_heads * a.head_dim + a.dim + a.ffn_dim)  # k, wo's output, w3's output
    assert est[1]["fits"] and not est[2]["fits"]
