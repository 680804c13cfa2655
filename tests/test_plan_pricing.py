"""What the per-operation model prices beyond the plain causal step (plan/cost/ops.py, plan/cost/estimate.py):
document masks (dense-mask SDPA against flex by block sparsity), the optimizer and gradient
accumulation over every parameter of an MoE model, fp8 GEMMs, the chunked loss, and a GPU at the
power limit a row ran at."""
from __future__ import annotations

import dataclasses

import pytest

from harness import make_config
from meshlm.core.config import ConfigError
from meshlm.core.model_args import PRESETS
from meshlm.plan.cost.estimate import GRAD_ACCUM_BYTES, Options, estimate, optimizer_bytes_per_param
from meshlm.plan.hardware import get_gpu
from meshlm.plan.cost.ops import causal_blocks
from meshlm.plan.spec import (PlanError, Shape, Spec, allgather_mask, attention_mask, code_options,
                              shape_from_config, spec_from_config, spec_of_layout)

H100 = get_gpu("h100")
ONE_B = Shape(PRESETS["llama3-1b"], "llama3-1b")
SEL = Spec(micro_batch=16, ac="selective", seq_len=2048)


def _attn(o: Options, spec: Spec = SEL) -> float:
    return estimate(ONE_B, spec, H100, o)["ops"]["attention_s"]


def test_block_sparsity_of_a_document_mask():
    assert causal_blocks(512, 0, 128) == 10             # 4 query blocks: 1 + 2 + 3 + 4
    assert causal_blocks(512, 128, 128) == 4            # one-block documents: the diagonal only
    assert causal_blocks(512, 256, 128) == 6            # two documents of two blocks: 3 each
    assert causal_blocks(512, 4096, 128) == causal_blocks(512)  # one document longer than the window


def test_document_mask_dense_sdpa_against_flex():
    """SDPA given a dense mask computes every pair at the memory-efficient kernel's rate; flex skips
    the blocks its BlockMask drops, so short documents cost less than long ones, and with the length
    unknown it is priced as causal (never optimistic)."""
    causal, dense = _attn(Options(compiled=True)), _attn(Options(compiled=True, attn_mask="dense"))
    flex_unknown = _attn(Options(compiled=True, attn_mask="flex"))
    flex_short = _attn(Options(compiled=True, attn_mask="flex", doc_tokens=256))
    assert dense > 2 * causal
    assert flex_unknown >= causal  # FA2's rate, no skipping
    assert flex_short == pytest.approx(flex_unknown * causal_blocks(2048, 256) / causal_blocks(2048))
    assert flex_short < causal < dense
    # the dense mask is a [B, 1, S, S] bool held through the step (the shared run's masked peak was 0.06
    # GiB above the unmasked one: 16 · 2048² bytes)
    mem = estimate(ONE_B, SEL, H100, Options(compiled=True, attn_mask="dense"))["memory_detail"]["buffers"]
    assert mem["attn_mask"] == 16 * 2048 ** 2


def test_config_keys_choose_the_mask():
    assert attention_mask(True, "auto") == "flex" and attention_mask(True, "sdpa") == "dense"
    assert attention_mask(False, "auto") == "causal" and attention_mask(False, "flex") == "flex"
    cfg = make_config(data__document_mask=True)
    cfg.model.attn_impl = "sdpa"  # the key as core/config/ carries it (set here whether or not it is declared)
    cfg.training.loss_chunks = 4
    assert code_options(cfg) == {"compiled": cfg.training.compile, "loss_chunks": 4, "attn_mask": "dense",
                                 "attn_impl": "sdpa"}
    cfg.model.attn_impl = "xformers"
    with pytest.raises(PlanError, match="model.attn_impl"):
        code_options(cfg)


def test_search_under_a_document_mask_runs_cp_with_the_allgather_core():
    """A document mask runs under CP through the all-gather core or Ulysses: the search gives every
    cp > 1 layout cp_impl = allgather, priced with the mask that core runs (flex under auto, a dense one
    under attn_impl = sdpa), unless Ulysses is pinned (priced with the mask it has without CP); a pinned
    ring finds nothing, and `estimate` refuses the ring with the data section's own one-line reason."""
    from meshlm.plan.search.ranked import plan
    for o, kind in ((Options(compiled=True, attn_mask="flex"), "flex"),
                    (Options(compiled=True, attn_mask="dense", attn_impl="sdpa"), "dense")):
        res = plan(ONE_B, H100, 8, 8192, 64 * 8192, top=5, fixed={"cp": 2}, o=o)
        assert res.ranked and {r["layout"]["cp_impl"] for r in res.ranked} == {"allgather"}
        spec = spec_of_layout(res.ranked[0]["layout"])
        priced = estimate(ONE_B, spec, H100, dataclasses.replace(o, attn_mask=kind))
        assert res.ranked[0]["step_s"] == pytest.approx(priced["step_s"])
        none = plan(ONE_B, H100, 8, 8192, 64 * 8192, top=5, fixed={"cp": 2, "cp_impl": "ring"}, o=o)
        assert not none.ranked and "a document mask under cp needs cp_impl = allgather or ulysses" in none.reasons
        # pinned Ulysses: its core attends the whole sequence under the mask it has without CP
        uly = plan(ONE_B, H100, 8, 8192, 64 * 8192, top=5, fixed={"cp": 2, "cp_impl": "ulysses"}, o=o)
        assert uly.ranked and {r["layout"]["cp_impl"] for r in uly.ranked} == {"ulysses"}
        top = uly.ranked[0]
        assert top["attn_mask"] == o.attn_mask
        assert top["step_s"] == pytest.approx(estimate(ONE_B, spec_of_layout(top["layout"]), H100, o)["step_s"])
        if kind == "dense":  # the whole [B, 1, S, S] mask on every rank
            assert top["memory_detail"]["buffers"]["attn_mask"] == top["layout"]["micro_batch"] * 8192 ** 2
    cfg = make_config(parallel__cp=2, data__document_mask=True)
    with pytest.raises(ConfigError, match="cp_impl = allgather or ulysses"):
        spec_from_config(cfg, 2)
    cfg.parallel.cp_impl = "ulysses"
    assert spec_from_config(cfg, 2).cp_impl == "ulysses"


def test_allgather_cp_mask_follows_attn_impl():
    """All-gather CP's queries sit at zig-zag positions, so SDPA would get a boolean mask (its causal
    rows, or the document mask's), priced at the dense-mask rate over every key; auto runs flex
    instead, priced as causal attention at FA2's rate over the blocks its BlockMask keeps (the
    sequence's, shared over cp), with no mask held or saved."""
    for docs, impl, kind in ((False, "auto", "flex"), (True, "auto", "flex"), (False, "flex", "flex"),
                             (False, "sdpa", "rows"), (True, "sdpa", "dense")):  # rows: one for the batch
        assert allgather_mask(attention_mask(docs, impl), impl) == kind
    assert allgather_mask("causal", None) == "causal"  # a published run's own causal kernel
    for cp_impl, impl, kind in (("allgather", "auto", "flex"), ("allgather", "sdpa", "rows"), ("ring", "auto", "causal")):
        cfg = make_config(parallel__cp=2, parallel__cp_impl=cp_impl)
        cfg.model.attn_impl = impl
        assert code_options(cfg)["attn_mask"] == "causal"  # the config's mask without CP
        est = estimate(shape_from_config(cfg), spec_from_config(cfg, 2), H100, Options(**code_options(cfg)))
        assert est["attn_mask"] == kind  # the layout's own
    spec = Spec(cp=2, micro_batch=16, ac="none", seq_len=8192)
    ring = dataclasses.replace(spec, cp_impl="ring")
    gather = dataclasses.replace(spec, cp_impl="allgather")
    rows = _attn(Options(compiled=True, attn_impl="sdpa"), gather)  # estimate resolves causal -> rows
    assert rows == pytest.approx(_attn(Options(compiled=True, attn_mask="rows"), gather))
    flex = _attn(Options(compiled=True), gather)  # auto: causal -> flex
    assert flex == pytest.approx(_attn(Options(compiled=True, attn_mask="flex"), gather))
    assert rows > 2 * _attn(Options(compiled=True), ring) and flex < rows / 2
    # flex over short documents: the sequence's kept blocks, not one rank's chunk's
    docs = _attn(Options(compiled=True, attn_mask="flex", doc_tokens=512), gather)
    assert docs == pytest.approx(flex * causal_blocks(8192, 512) / causal_blocks(8192))
    mem = [estimate(ONE_B, gather, H100, Options(compiled=True, attn_mask=k, attn_impl=i))["per_gpu"]
           for k, i in (("rows", "sdpa"), ("flex", "auto"))]
    assert mem[1]["activations"] < mem[0]["activations"] and mem[1]["total"] < mem[0]["total"]
    detail = estimate(ONE_B, gather, H100, Options(compiled=True))["memory_detail"]["buffers"]
    assert "attn_mask" not in detail


def test_moe_optimizer_and_accumulation_cover_every_parameter():
    """Only top_k experts run per token, but AdamW, clipping and the fp32 gradient accumulation touch
    all of them: those seconds do not depend on top_k, and equal bytes per parameter over HBM."""
    base = PRESETS["deepseek-moe-16b"]
    spec = Spec(micro_batch=8, ac="selective", seq_len=2048)
    ests = [estimate(Shape(dataclasses.replace(base, n_layers=4, top_k=k), "moe"), spec, H100, Options(compiled=True))
            for k in (2, 6)]
    assert ests[0]["time"]["optimizer_s"] == pytest.approx(ests[1]["time"]["optimizer_s"])
    assert ests[0]["ops"]["grad_accum_s"] == pytest.approx(ests[1]["ops"]["grad_accum_s"])
    assert ests[0]["ops"]["gemm_s"] < ests[1]["ops"]["gemm_s"]  # the math does follow top_k
    n, bw = ests[1]["params"], H100.hbm_bw * H100.hbm_eff
    assert ests[1]["time"]["optimizer_s"] == pytest.approx(n * optimizer_bytes_per_param("bf16") / bw, rel=1e-6)
    assert ests[1]["ops"]["grad_accum_s"] == pytest.approx(n * GRAD_ACCUM_BYTES / bw, rel=1e-6)


def test_fp8_speeds_the_block_gemms_only():
    """fp8 runs the blocks' linears at the card's fp8 GEMM rate (1.58x bf16, ceilings.json's least),
    adds the casts, leaves the head and attention in bf16 and keeps bf16 activations (torchao saves
    the high-precision input)."""
    o = Options(compiled=True)
    bf, f8 = (estimate(ONE_B, dataclasses.replace(SEL, precision=p), H100, o) for p in ("bf16", "fp8"))
    assert f8["ops"]["head_s"] == pytest.approx(bf["ops"]["head_s"])
    assert f8["ops"]["attention_s"] == pytest.approx(bf["ops"]["attention_s"])
    block_bf, block_f8 = bf["ops"]["gemm_s"], f8["ops"]["gemm_s"]
    assert block_bf / H100.fp8_gemm_speedup <= block_f8 < block_bf / 1.4
    assert f8["ops"]["elementwise_s"] > bf["ops"]["elementwise_s"]  # the casts
    assert bf["step_s"] / 1.58 < f8["step_s"] < bf["step_s"]
    assert f8["per_gpu"]["total"] == pytest.approx(bf["per_gpu"]["total"])


def test_loss_chunks_hold_one_chunks_logits():
    """A chunked loss saves no logits and holds one chunk's fp32 logits and gradient at a time; its
    backward makes the chunk's logits again (one more head forward)."""
    o = Options(compiled=True)
    plain, chunked = estimate(ONE_B, SEL, H100, o), estimate(ONE_B, SEL, H100, dataclasses.replace(o, loss_chunks=8))
    rows, tokens = 128256, 16 * 2048
    assert chunked["memory_detail"]["buffers"]["loss"] == pytest.approx(tokens * 8 * rows / 8)
    assert chunked["per_gpu"]["total"] < plain["per_gpu"]["total"] - 5 * 2 ** 30
    head_fwd = plain["ops"]["head_s"] / 3  # forward, input gradient, weight gradient: the same GEMM size
    assert chunked["ops"]["head_s"] == pytest.approx(plain["ops"]["head_s"] + head_fwd, rel=0.05)


def test_power_limited_profile():
    """torchtitan's 500 W H100s: a named profile between the 400 W and 700 W datasheet peaks."""
    g, full = get_gpu("h100-500w"), get_gpu("h100-96gb")
    assert 835e12 < g.peak_flops < full.peak_flops and g.hbm_bytes == full.hbm_bytes
    spec = Spec(dp=8, zero=3, zero_group=8, micro_batch=2, ac="op", seq_len=8192)
    sh = Shape(PRESETS["llama3-8b"], "llama3-8b")
    assert estimate(sh, spec, g)["step_s"] > estimate(sh, spec, full)["step_s"]
