"""The search prices a layout as `meshlm estimate` does: one memory model (memory.stage_memory) and one
time model, the config's own knobs (bucket_mb, reduce_dtype) included. For each feature that changes a
price (hpZ, qwZ/qgZ, buckets, optimizer offload, Muon, MoE, a document mask with the chunked loss), the
search's own memory and step time of its chosen layout equal `meshlm estimate` of the config that
`meshlm plan --emit-config` would write for it."""
import argparse
import json
from types import SimpleNamespace

import pytest

from meshlm.core import config as C
from meshlm.plan import cli as cli_cmds
from meshlm.plan.cost.estimate import Options, estimate
from meshlm.plan.hardware import get_gpu
from meshlm.plan.search.ranked import parse_fix, plan
from meshlm.plan.spec import (code_options, priced_on, search_knobs, shape_from_config, spec_from_config,
                              spec_of_layout, to_config)

# name, preset, gpu, GPUs, seq_len, sequences per step, --fix, config keys, what the chosen layout must use
CASES = [
    ("hpz", "llama3-8b", "h100", 32, 4096, 256, ["zero=3", "hpz_group=8"], {},
     lambda s: s.hpz_group == 8 and s.zeropp_enabled),
    ("qwz-qgz", "llama3-8b", "h100", 16, 4096, 128, ["zero=3", "quantize_weights=true", "quantize_grads=true"], {},
     lambda s: s.quantize_weights and s.quantize_grads),
    ("buckets", "llama3-1b", "h100", 8, 4096, 64, ["zero=0", "pp=1"],
     {"parallel.bucket_mb": 100.0, "parallel.reduce_dtype": "bf16"},
     lambda s: s.bucket_mb == 100.0 and s.reduce_dtype == "bf16" and s.dp_cp_enabled),
    ("offload", "llama3-8b", "a100-40gb", 4, 4096, 32, ["offload=optimizer"], {},
     lambda s: s.offload == "optimizer"),
    ("muon", "llama3-1b", "h100", 8, 4096, 64, ["pp=1"], {"optim.name": "muon"},
     lambda s: s.optim == "muon"),
    ("moe", "mixtral-8x7b", "h100", 16, 4096, 128, ["ep=4", "pp=1"], {},
     lambda s: s.ep_enabled),
    ("mask-chunks", "llama3-1b", "h100", 8, 4096, 64, ["cp=2"],
     {"data.document_mask": True, "model.attn_impl": "sdpa", "training.loss_chunks": 4},
     lambda s: s.cp_enabled and s.cp_impl == "allgather"),
]


def _estimate_cli(argv, capsys) -> dict:
    p = argparse.ArgumentParser(prog="meshlm")
    cli_cmds.add_parsers(p.add_subparsers(dest="command", required=True))
    args, extra = p.parse_known_args(argv)
    assert args.func(args, extra) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name,preset,gpu_name,n,seq,sequences,fix,keys,uses", CASES, ids=[c[0] for c in CASES])
def test_search_prices_its_layout_as_estimate(name, preset, gpu_name, n, seq, sequences, fix, keys, uses, tmp_path,
                                              capsys):
    cfg = C.Config()
    for key, value in {"model.preset": preset, "data.seq_len": seq, "training.global_batch": sequences,
                       **keys}.items():
        C.apply(cfg, key, value)
    cfg = priced_on(cfg, gpu=True)
    shape, gpu = shape_from_config(cfg), get_gpu(gpu_name)
    res = plan(shape, gpu, n, seq, seq * sequences, cfg.training.precision, top=3, fixed=parse_fix(fix),
               o=Options(**code_options(cfg)), optim=cfg.optim.name, knobs=search_knobs(cfg))
    assert res.ranked, f"{name}: nothing fits"
    spec, searched_bytes, searched_step = res.prices[0]
    assert uses(spec), (name, spec)
    # the config `meshlm plan --emit-config` writes for the chosen row, and `meshlm estimate` of it
    path = tmp_path / "emitted.toml"
    path.write_text(C.to_toml(to_config(shape, spec_of_layout(res.ranked[0]["layout"]), cfg)))
    emitted = priced_on(C.load(str(path)), gpu=True)
    assert spec_from_config(emitted, n) == spec  # every priced key survives the round trip
    out = _estimate_cli(["estimate", "--config", str(path), "--gpu", gpu_name, "--gpus", str(n), "--json"], capsys)
    assert out["per_gpu"]["total"] == searched_bytes and out["fits"]
    # the search ranks by the bubble formula: estimate's step without the schedule simulator
    plain = estimate(shape, spec_from_config(emitted, n), gpu, Options(**code_options(emitted), simulate=False))
    assert plain["step_s"] == searched_step
    if not spec.pp_enabled:
        assert out["step_s"] == searched_step


def test_search_lower_bound_never_exceeds_the_model():
    """The search's compute-only bound on the step time stays under the full time model (its memory is
    estimate's own: tests/test_plan_search_prices.py)."""
    from meshlm.plan.cost.estimate import time_model
    from meshlm.plan.search.grouped import group_lower_bound
    from meshlm.plan.spec import Shape, Spec, presets
    sh, gpu, o = Shape(presets()["llama3-70b"], "llama3-70b"), get_gpu("h100"), Options()
    for s in [Spec(dp=2, tp=8, pp=4, sp=True, accum=16, micro_batch=2, ac="selective", seq_len=4096),
              Spec(dp=4, tp=4, pp=4, cp=2, zero=3, zero_group=4, pp_schedule="interleaved", pp_virtual=2,
                   accum=8, ac="none", seq_len=8192),
              Spec(dp=8, tp=8, zero=1, zero_group=8, pp=1, accum=4, ac="full", offload="optimizer", seq_len=8192),
              Spec(dp=2, pp=8, pp_schedule="gpipe", accum=8, ac="full", precision="fp32", seq_len=2048)]:
        lb = group_lower_bound(SimpleNamespace(shape=sh, gpu=gpu, micro={}), o, s, s.ac)
        assert lb <= time_model(sh, s, gpu, o, simulate=False)["step_s"] * (1 + 1e-9)
    ds = Shape(presets()["deepseek-v3"], "deepseek-v3")  # MLA, routed experts, the MTP module on the last stage
    for s in [Spec(dp=256, ep=64, pp=4, pp_schedule="zbv", pp_virtual=2, zero=1, accum=15, ac="full", seq_len=4096),
              Spec(dp=128, ep=32, tp=2, sp=True, pp=4, accum=30, ac="selective", seq_len=4096),
              Spec(dp=256, ep=64, pp=4, zero=1, accum=15, ac="full", seq_len=4096, precision="fp8",
                   fp8_comm=("ep",))]:
        lb = group_lower_bound(SimpleNamespace(shape=ds, gpu=gpu, micro={}), o, s, s.ac)
        model = time_model(ds, s, gpu, o, simulate=False)
        assert lb <= model["step_s"] * (1 + 1e-9)
        ep = sum(c["seconds"] for c in model["comm"] if c["group"] == "ep")
        assert lb >= ep > 0  # the bound holds the never-hidden all-to-alls (most of DeepSeek-V3's exposed time)
