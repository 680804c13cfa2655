"""The planner's validation table (docs/planner.md, "Validation"): predictions of the per-operation
time model against published and measured runs, each row within 15% in tokens/s per GPU (or 6 MFU
points), or inside the band docs/planner.md documents together with the assumption that differs.

Every row sets seq_len explicitly and depends on no preset's max_seq_len. Measured values are copied
from their sources (named per row); nothing in plan/ is fitted to them.
"""
from __future__ import annotations

import pytest

from meshlm.model.args import PRESETS, ModelArgs
from meshlm.plan.estimate import Options, estimate
from meshlm.plan.hardware import get_gpu
from meshlm.plan.ops import gemm_seconds
from meshlm.plan.search import plan
from meshlm.plan.spec import Shape, Spec

H100 = get_gpu("h100")


def _preset(name: str) -> Shape:
    return Shape(PRESETS[name], name)


def _tok_from_mfu(shape: Shape, seq: int, mfu: float, peak: float) -> float:
    """Tokens/s per GPU that an MFU implies under meshlm's FLOPs per token (6N + 12·L·d·S)."""
    return mfu * peak / shape.flops_per_token(seq)


# ---------------------------------------------------------------------------------------------- rows
# (name, shape, spec, gpu, options, measured tokens/s per GPU, source, band): band None = met (within 15%
# in tokens/s or 6 MFU points); otherwise the (low, high) of predicted/measured − 1 that docs/planner.md
# documents next to the assumption that differs.
OK = None


def _meshlm_h100():
    """docs/benchmarks.md "GPU (bench/gpu.py)": one H100 80GB SXM, seq 2048, bf16, SDPA picked cuDNN."""
    rows = []
    for name, mb, ac, compiled, tok in [("llama3-1b", 16, "selective", True, 66834),
                                         ("llama3-1b", 8, "none", True, 64823),
                                         ("llama3-1b", 8, "selective", False, 43066),
                                         ("llama3-3b", 4, "selective", True, 22748)]:
        rows.append((f"meshlm {name} mb{mb} {ac} {'compiled' if compiled else 'eager'}", _preset(name),
                     Spec(micro_batch=mb, ac=ac, seq_len=2048), H100, Options(compiled=compiled), tok,
                     "docs/benchmarks.md", OK))
    # small (dim 256): 23.9% MFU measured; the model's GEMMs are HBM-bound at this width
    rows.append(("meshlm small mb64 none compiled", _preset("small"), Spec(micro_batch=64, ac="none", seq_len=2048),
                 H100, Options(compiled=True), 3218404, "docs/benchmarks.md", OK))
    return rows


# torchtitan's selective AC "op" (torchtitan/models/llama/parallelize_llama.py, _apply_ac_to_transformer_block):
# the outputs of aten.mm and SDPA are saved "except every second mm", everything else is recomputed. Per
# block the forward runs wq wk wv (Attention.forward), wo, then w1 w3 w2 (FeedForward: w2(silu(w1(x)) *
# w3(x))), so the 2nd, 4th and 6th matmuls (wk, wo, w3) and every element-wise op run again; attention
# does not. meshlm's "selective" (the attention core again) is a different policy.
TORCHTITAN_OP_AC = ("wk", "wo", "w3")


def _torchtitan():
    """torchtitan docs/performance.md Table 1: Llama 3.1 8B, 8 H100 96GB HBM2e at 500 W, FSDP, seq 8192,
    local batch 2, selective (op) AC, bf16; torch's SDPA of Dec. 2024 ran FlashAttention-2."""
    spec = Spec(dp=8, zero=3, zero_group=8, micro_batch=2, ac="op", seq_len=8192)
    g = get_gpu("h100-96gb")
    # not met: the 500 W power limit (clock unknown; the model keeps the 700 W peak) - docs/planner.md
    return [("torchtitan llama3-8b FSDP8 eager", _preset("llama3-8b"), spec, g,
             Options(compiled=False, attn_kernel="fa2", recompute_gemms=TORCHTITAN_OP_AC), 5762,
             "torchtitan docs/performance.md", (0.15, 0.35)),
            ("torchtitan llama3-8b FSDP8 compiled", _preset("llama3-8b"), spec, g,
             Options(compiled=True, attn_kernel="fa2", recompute_gemms=TORCHTITAN_OP_AC), 6667,
             "torchtitan docs/performance.md", (0.35, 0.55))]


def _llama3_table4():
    """Llama 3 paper (Dubey et al. 2024) Table 4: 405B, TP 8 + SP, PP 16, 16M-token batches, H100 80GB;
    interleaved v 4, ZeRO-1 over DP, compiled, no AC (docs/planner.md reads the setup)."""
    sh = _preset("llama3-405b")
    rows = []
    for gpus, dp, cp, seq, m, mfu, band in [(8192, 64, 1, 8192, 32, 0.43, (0.10, 0.25)),
                                            (16384, 128, 1, 8192, 16, 0.41, OK),
                                            (16384, 8, 16, 131072, 16, 0.38, (0.35, 0.55))]:
        s = Spec(dp=dp, tp=8, sp=True, pp=16, cp=cp, zero=1, zero_group=dp, pp_schedule="interleaved",
                 pp_virtual=4, micro_batch=1, accum=m, ac="none", precision="bf16", seq_len=seq)
        assert s.world == gpus
        rows.append((f"Llama 3 405B {gpus} GPUs cp{cp} seq {seq}", sh, s, H100, Options(compiled=True),
                     _tok_from_mfu(sh, seq, mfu, H100.peak_flops), "Llama 3 paper Table 4", band))
    return rows


# Narayanan et al. 2021 (Megatron-LM, SC'21) Table 1: GPT, seq 2048, vocab 51200, A100 80GB (Selene),
# fp16, full recomputation; (name, heads, hidden, layers, tp, pp, gpus, global batch, TFLOP/s per GPU)
MEGATRON = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
            ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163)]
MEGATRON_BAND = {"18.4B": (0.10, 0.25)}


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
               fixed=fixed, o=Options(compiled=True, flash=False, attn_dropout=True))
    assert res.ranked, res.reasons
    return res.ranked[0]


ROWS = _meshlm_h100() + _torchtitan() + _llama3_table4()


def _check(name: str, pred: float, meas: float, band: tuple | None, flops_per_token: float, peak: float) -> None:
    err = pred / meas - 1
    dmfu = (pred - meas) * flops_per_token / peak
    print(f"{name}: predicted {pred:,.1f} tok/s/GPU, measured {meas:,.1f} ({err:+.1%}, {100 * dmfu:+.1f} MFU points)")
    if band is None:
        assert abs(err) <= 0.15 or abs(dmfu) <= 0.06, f"{name}: {err:+.1%}, {100 * dmfu:+.1f} MFU points"
    else:
        assert band[0] <= err <= band[1] and not (abs(err) <= 0.15 or abs(dmfu) <= 0.06), \
            f"{name}: {err:+.1%} outside the documented {band} (or now met: update docs/planner.md)"


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_validation_row(row):
    name, sh, spec, gpu, o, measured, _, band = row
    est = estimate(sh, spec, gpu, o)
    _check(name, est["tokens_per_s_per_gpu"], measured, band, sh.flops_per_token(spec.seq_len), gpu.peak_flops)


@pytest.mark.parametrize("row", MEGATRON, ids=[r[0] for r in MEGATRON])
def test_validation_megatron(row):
    name, heads, h, layers, tp, pp, gpus, batch, tflops = row
    r = _megatron_predicted(name, heads, h, layers, tp, pp, gpus, batch)
    _check(f"Megatron {name}", r["tokens_per_s_per_gpu"], _megatron_tokens(h, layers, tflops),
           MEGATRON_BAND.get(name, OK), _megatron_shape(heads, h, layers).flops_per_token(2048), 312e12)


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
