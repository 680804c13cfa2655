"""bench/kernels.py's cases and the planner's predictions for them: pure Python, no device.

Which shapes are measured (the validation rows' models, the FlashAttention-3 figure's grid, the block
GEMMs, the element-wise ops) and what meshlm.plan.cost.ops predicts for each, so that the tests can check the
shape lists and the predictions without a GPU, and kernels.py keeps to the timing."""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from meshlm.core.model_args import PRESETS, ModelArgs  # noqa: E402
from meshlm.plan.cost import ops  # noqa: E402
from meshlm.plan.cost.activations import vocab_rows  # noqa: E402
from meshlm.plan.cost.estimate import Options  # noqa: E402
from meshlm.plan.hardware import GPU  # noqa: E402

# backend -> the ops.KERNELS entry that prices it. flex: the planner prices it at FlashAttention-2's
# rate (ops.attention_seconds). efficient: priced only under a dense mask (ops.DENSE_MASK_FRACTION).
# math runs only for the CPU plumbing test: it gets the planner's default kernel so that its ratio
# fields are filled, and the ratio means nothing there.
PLANNER_KERNEL = {"cudnn": "cudnn", "flash": "fa2", "flex": "fa2", "efficient": None,
                  "math": Options().attn_kernel}
BWD_FLOPS = 2.5  # backward FLOPs / forward FLOPs of an attention core (dQ, dK, dV and the recomputed P)

# Megatron-LM's GPT 1.7B and 18.4B (Narayanan et al. 2021 Table 1) as tests/test_plan_validation.py models
# them (_megatron_shape: SwiGLU of 8h/3 rounded to 64, multi-head, tied, vocabulary 51,200)
MEGATRON_1_7B = ModelArgs(dim=2304, n_layers=24, n_heads=24, n_kv_heads=24, ffn_dim=6144, vocab_size=51200,
                          max_seq_len=2048, tie_embeddings=True)
MEGATRON_18_4B = dataclasses.replace(MEGATRON_1_7B, dim=6144, n_layers=40, n_heads=48, n_kv_heads=48, ffn_dim=16384)


@dataclasses.dataclass(frozen=True)
class ModelRow:
    """A validation row's model as one rank sees it: its tensor-parallel share and one micro-batch."""
    name: str
    args: ModelArgs
    tp: int
    micro_batch: int
    seq: int
    precision: str = "bf16"
    row: str = ""

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq


MODELS = (
    ModelRow("llama3-8b", PRESETS["llama3-8b"], 1, 2, 8192, row="torchtitan llama3-8b FSDP8 (FA2)"),
    ModelRow("llama3-1b", PRESETS["llama3-1b"], 1, 16, 2048, row="meshlm llama3-1b mb16 (shared H100)"),
    ModelRow("llama3-405b-tp8", PRESETS["llama3-405b"], 8, 1, 8192, row="Llama 3 405B, TP 8 + SP"),
    ModelRow("megatron-1.7b", MEGATRON_1_7B, 1, 16, 2048, "fp16", row="Megatron-LM 1.7B (A100, fp16)"),
    # micro-batch 8: Megatron-LM's examples/sc21/run_table_1.sh for this row
    ModelRow("megatron-18.4b-tp8", MEGATRON_18_4B, 8, 8, 2048, "fp16", row="Megatron-LM 18.4B, TP 8 (A100, fp16)"),
)
TINY_MODELS = (ModelRow("debug", PRESETS["debug"], 1, 2, 32, "fp32"),
               ModelRow("debug-gqa", dataclasses.replace(PRESETS["debug"], n_kv_heads=2), 1, 2, 32, "fp32"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------ cases (pure Python)

def attention_cases(quick: bool, tiny: bool, models=MODELS) -> list[dict]:
    """The validation rows' shapes first (with llama3-1b's dense-mask variant), then the FA3 figure's
    grid: batch·seq fixed at 16k tokens (64 tokens tiny), hidden 2048 (32 tiny), so heads = hidden / hd."""
    cases = []
    for m in models:
        a = m.args
        base = dict(group=m.name, batch=m.micro_batch, heads=a.n_heads // m.tp,
                    kv_heads=-(-a.n_kv_heads // m.tp), seq=m.seq, head_dim=a.head_dim, causal=True, mask="none",
                    precision=m.precision)
        cases.append(base)
        if m.name in ("llama3-1b", "debug"):  # data.document_mask under attn_impl = "sdpa"
            cases.append(dict(base, mask="dense"))
    tokens, hidden = (64, 32) if tiny else (16384, 2048)
    seqs = (16, 32) if tiny else (512, 2048, 8192, 16384) if quick else ops.SEQS
    dims = (8,) if tiny else (128,) if quick else (128, 64)
    longs = () if tiny else (32768, 131072) if quick else (32768, 65536, 131072)
    grid = [(hd, causal, s) for hd in dims for causal in (True, False) for s in seqs]
    grid += [(dims[0], True, s) for s in longs]  # batch 1 past 16k tokens
    for hd, causal, s in grid:
        cases.append(dict(group="fa3-fig5", batch=max(1, tokens // s), heads=hidden // hd, kv_heads=hidden // hd,
                          seq=s, head_dim=hd, causal=causal, mask="none", precision="fp32" if tiny else "bf16"))
    return cases


def flex_wanted(case: dict, quick: bool, tiny: bool) -> bool:
    """flex compiles once per shape (tens of seconds): the rows' causal shapes and a few grid points."""
    if case["mask"] != "none":
        return False
    if case["group"] != "fa3-fig5":
        return case["group"] in ("llama3-8b", "llama3-1b") or (not quick and case["group"].startswith("llama3"))
    return not quick and not tiny and case["causal"] and case["head_dim"] == 128 and case["seq"] in (2048, 8192, 16384)


def attention_flops(case: dict) -> float:
    """Forward FLOPs of QKᵀ and PV, 4·B·H·S²·hd: causal counted as half (the FA3 figure's count, and
    the planner's), a dense mask in full (the kernel it selects skips nothing)."""
    full = 4.0 * case["batch"] * case["heads"] * case["seq"] ** 2 * case["head_dim"]
    return full / 2 if case["causal"] and case["mask"] == "none" else full


def fwd_bwd_rate(fwd: float, bwd: float) -> float:
    """The rate over a forward and its backward (2.5x the FLOPs) run at these two rates."""
    return (1 + BWD_FLOPS) / (1 / fwd + BWD_FLOPS / bwd)


def predicted_attention(case: dict, backend: str, gpu: GPU) -> dict | None:
    """The planner's forward and backward rates (FLOP/s) for this backend at this shape, as
    ops.attention_seconds prices them; None where no planner table prices the backend."""
    peak = gpu.peak(case["precision"])
    if case["mask"] == "dense":
        if backend not in ("efficient", "math"):
            return None
        rate = peak * ops.DENSE_MASK_FRACTION * gpu.attn_scale
        return {"kernel": "dense-mask", "fwd": rate, "bwd": rate}
    kernel = PLANNER_KERNEL[backend]
    if kernel is None:
        return None
    kernel = "fa2" if gpu.arch != "hopper" else kernel
    fwd = ops.attention_fraction(kernel, case["head_dim"], case["seq"], case["causal"], gpu.arch) * peak * gpu.attn_scale
    return {"kernel": kernel, "fwd": fwd, "bwd": fwd * ops.BWD_RATIO[kernel]}


def gemm_cases(models=MODELS) -> list[dict]:
    """Each model's block GEMMs and output head at its tokens per micro-batch, with the planner's
    (m, n, k) as ops.stage_compute's gemm3 passes them: forward x·Wᵀ (T, n, k), input gradient g·W
    (T, k, n), weight gradient gᵀ·x (k, n, T). Shapes several weights share are measured once."""
    out = {}
    for m in models:
        a, t, T = m.args, m.tp, m.tokens
        q, kv = a.n_heads // t * a.head_dim, -(-a.n_kv_heads // t) * a.head_dim
        f, d = a.ffn_dim // t, a.dim
        weights = (("wq", q, d), ("wk", kv, d), ("wv", kv, d), ("wo", d, q), ("w1", f, d), ("w3", f, d),
                   ("w2", d, f), ("head", vocab_rows(a, t), d))
        for w, n, k in weights:
            for role, mnk in (("fwd", (T, n, k)), ("dgrad", (T, k, n)), ("wgrad", (k, n, T))):
                key = (m.name, role, T, n, k)
                if key in out:
                    out[key]["weights"] += "," + w
                else:
                    out[key] = dict(group=m.name, weights=w, role=role, tokens=T, n=n, k=k, mnk=mnk,
                                    precision=m.precision)
    return list(out.values())


def predicted_gemm(case: dict, gpu: GPU, fp8: bool = False) -> tuple[float, float]:
    """(FLOP/s, wave efficiency) the planner's ops.gemm_seconds gives this GEMM on `gpu`; `fp8`: as
    ops.stage_compute prices a block GEMM under training.precision = "fp8" (peak × fp8_gemm_speedup)."""
    m, n, k = case["mnk"]
    e = 4 if case["precision"] == "fp32" else 2
    peak = gpu.peak(case["precision"]) * (gpu.fp8_gemm_speedup if fp8 else 1.0)
    return 2.0 * m * n * k / ops.gemm_seconds(m, n, k, gpu, e, peak), ops.wave_efficiency(m, n, gpu.sms, k)


def fp8_wanted(case: dict) -> bool:
    """torchao's float8 linears: the block GEMMs of bf16 rows (the output head stays bf16)."""
    return case["precision"] == "bf16" and case["weights"] != "head"


# element-wise op -> (the planner's ops._eager entries it covers, the width it runs over)
ELEMENTWISE = {"copy": (("copy",), "dim"), "rmsnorm_fwd": (("norm_f",), "dim"),
               "rmsnorm_fwd_bwd": (("norm_f", "norm_b"), "dim"), "silu_mul_fwd": (("swiglu_f",), "ffn"),
               "silu_mul_bwd": (("swiglu_b",), "ffn")}


def elementwise_cases(tiny: bool) -> list[dict]:
    """llama3-8b's widths at its 16384 tokens (the torchtitan row, whose eager kernels are in question)."""
    m = TINY_MODELS[0] if tiny else MODELS[0]
    width = {"dim": m.args.dim, "ffn": m.args.ffn_dim}
    return [dict(op=op, tokens=m.tokens, width=width[w], precision=m.precision) for op, (_, w) in ELEMENTWISE.items()]


def predicted_elementwise(case: dict, gpu: GPU) -> dict:
    """The planner's bytes (ops._eager per unit of width) and seconds (bytes at hbm_bw · hbm_eff, or
    the kernels' eager launches where longer: ops._parts) of this op."""
    e = 4 if case["precision"] == "fp32" else 2
    table = ops._eager(e)
    units = case["tokens"] * case["width"]
    nbytes = sum(table[p][0] for p in ELEMENTWISE[case["op"]][0]) * units
    kernels = sum(table[p][1] for p in ELEMENTWISE[case["op"]][0])
    data_s, launch_s = ops._parts(nbytes / (gpu.hbm_bw * gpu.hbm_eff), kernels, gpu.launch_eager_s, cpu=False)
    return {"bytes": nbytes, "kernels": kernels, "seconds": data_s + launch_s, "bw": gpu.hbm_bw * gpu.hbm_eff}


def format_table(rows: list[dict], columns: list[tuple]) -> str:
    """Rows as aligned text; columns are (header, key, format); a missing value prints as '-'."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else fmt.format(r[k])) for _, k, fmt in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


ATTN_COLUMNS = [("group", "group", "{}"), ("backend", "backend", "{}"), ("B", "batch", "{}"), ("H", "heads", "{}"),
                ("KV", "kv_heads", "{}"), ("seq", "seq", "{}"), ("hd", "head_dim", "{}"), ("causal", "causal", "{}"),
                ("mask", "mask", "{}"), ("fwd TF/s", "fwd_tflops", "{:.4g}"), ("bwd TF/s", "bwd_tflops", "{:.4g}"),
                ("pred fwd", "pred_fwd_tflops", "{:.4g}"), ("pred bwd", "pred_bwd_tflops", "{:.4g}"),
                ("fwd ratio", "ratio_fwd", "{:.3g}"), ("bwd ratio", "ratio_bwd", "{:.3g}"),
                ("f+b ratio", "ratio_fwdbwd", "{:.3g}")]
GEMM_COLUMNS = [("model", "group", "{}"), ("weights", "weights", "{}"), ("role", "role", "{}"),
                ("m,n,k", "shape", "{}"), ("TF/s", "tflops", "{:.4g}"), ("pred", "pred_tflops", "{:.4g}"),
                ("wave", "wave", "{:.3g}"), ("ratio", "ratio", "{:.3g}"), ("fp8 TF/s", "fp8_tflops", "{:.4g}"),
                ("fp8 pred", "pred_fp8_tflops", "{:.4g}"), ("fp8/bf16", "fp8_speedup", "{:.3g}"),
                ("fp8 ratio", "fp8_ratio", "{:.3g}")]
EW_COLUMNS = [("op", "op", "{}"), ("tokens", "tokens", "{}"), ("width", "width", "{}"), ("ms", "ms", "{:.4g}"),
              ("GB/s (planner bytes)", "gbps", "{:.0f}"), ("hbm_bw·eff GB/s", "pred_gbps", "{:.0f}"),
              ("pred ms", "pred_ms", "{:.4g}"), ("ratio", "ratio", "{:.3g}")]


def ratio(measured, predicted):
    return measured / predicted if measured and predicted else None
