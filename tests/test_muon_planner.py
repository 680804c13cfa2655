"""Muon in the planner: the matrices and bytes it prices are the runtime's (tests/test_muon.py holds the
optimizer and its layouts), the tp exchange's buffer, the search without offload, and the bench's smoke."""
from __future__ import annotations

import pytest
from harness import make_config
from test_muon import _model

from meshlm.parallel.model_plans.moe import model_plan_for


def test_planner_counts_the_runtime_muon_matrices_and_prices_them():
    from meshlm.plan.cost.estimate import estimate
    from meshlm.plan.hardware import get_gpu
    from meshlm.plan.cost.muon import block_matrices
    from meshlm.plan.spec import Spec, shape_from_config

    for preset in ("debug", "moe-debug"):
        cfg = make_config(model__preset=preset)
        model, named = _model(preset)
        runtime = sum(p.numel() for n, p in named if n in model_plan_for(model).muon_params(model))
        shape = shape_from_config(cfg)
        planned = shape.args.n_layers * sum(r * c * k for r, c, k in block_matrices(shape))
        assert planned == pytest.approx(runtime), preset
    shape, gpu = shape_from_config(make_config(model__preset="debug")), get_gpu("h100-sxm-80gb")
    for layout in ({}, {"tp": 2, "dp": 2}, {"dp": 4, "zero": 3, "zero_group": 4}):
        adamw, muon = (estimate(shape, Spec(**layout, optim=o, seq_len=64), gpu) for o in ("adamw", "muon"))
        a, m = adamw["per_gpu"], muon["per_gpu"]
        local = shape.args.n_layers * sum(r * c * k for r, c, k in block_matrices(shape)) / layout.get("tp", 1)
        want = -4 * local / (4 if layout.get("zero") else 1)  # one momentum for two moments
        assert m["optim"] - a["optim"] == pytest.approx(want)
        assert muon["time"]["muon_ns_s"] > 0 and muon["step_s"] > adamw["step_s"]
        def per_step(r):
            return {(c["group"], c["kind"]) for c in r["comm"] if c["per"] == "step" and c["bytes"] > 0}
        extra = per_step(muon) - per_step(adamw)
        assert extra == ({("tp", "all_to_all")} if layout.get("tp") else set()) | (
            {("dp_shard", "all_to_all")} if layout.get("zero") else set())


def test_planner_muon_tp_buffer_is_one_bucket_whatever_the_depth():
    """Without ZeRO the tp exchange holds one bucket: the buffers of a 2- and a 20-layer model at tp2
    are the same once a step's slices pass the cap; with the cap above them it is the step's."""
    from meshlm.plan.cost.estimate import estimate
    from meshlm.plan.cost.muon import block_matrices, muon_tp_bucket_bytes
    from meshlm.plan.spec import Spec, shape_from_config

    s = Spec(tp=2, optim="muon", seq_len=64, bucket_mb=40 / 1024)
    shapes = [shape_from_config(make_config(model__n_layers=n)) for n in (2, 20)]
    got = [estimate(sh, s)["per_gpu"]["buffers"] for sh in shapes]
    assert got[0] == got[1] > 0
    adamw = [estimate(sh, Spec(tp=2, seq_len=64))["per_gpu"]["buffers"] for sh in shapes]
    assert got[0] - adamw[0] == got[1] - adamw[1]
    step = 2 * sum(r * c * k for r, c, k in block_matrices(shapes[0])) / 2  # two blocks' slices at tp2
    big = Spec(tp=2, optim="muon", seq_len=64, bucket_mb=1.0)  # 2**18 fp32 elements: above 2 blocks', under 20
    whole = 128 * 64  # the largest matrix (w1)
    assert muon_tp_bucket_bytes(shapes[0], big, 2) == 4 * (step + step + whole)  # one bucket: the step's
    assert muon_tp_bucket_bytes(shapes[1], big, 20) == 4 * 2 * 2 ** 18  # capped both ways


@pytest.mark.slow
def test_optim_muon_bench_smoke():
    from test_bench import run_json

    out = run_json("bench/optim_muon.py", "--models", "tiny", "--steps", "6", "--lrs", "3e-3", "--eval-every", "3",
                   "--json")
    runs = out["tiny"]
    assert {r["optim"] for r in runs} == {"adamw", "muon"}
    assert all(set(r["evals"]) == {"3", "6"} for r in runs)
    adamw = next(r for r in runs if r["optim"] == "adamw")
    assert adamw["steps_to_target"] == 6  # AdamW's last held-out loss is the target it sets


def test_search_prices_muon_without_offload():
    """stage_memory (the search's memory, as estimate's) carries Muon's buffer; the search ranks Muon
    layouts with Muon's Newton-Schulz time and never with optimizer offload, which Muon runs without."""
    from meshlm.plan.hardware import get_gpu
    from meshlm.plan.cost.memory import stage_memory
    from meshlm.plan.search.ranked import plan
    from meshlm.plan.spec import PlanError, Spec, shape_from_config

    shape, gpu = shape_from_config(make_config()), get_gpu("h100-sxm-80gb")
    for s in (Spec(dp=4, zero=3, zero_group=4, seq_len=64, optim="muon"), Spec(dp=2, tp=2, seq_len=64, optim="muon"),
              Spec(dp=4, zero=2, zero_group=2, cp=2, seq_len=64, optim="muon")):
        want = stage_memory(shape, s, "only").breakdown()
        assert want["detail"]["buffers"]["muon"] > 0
    ranked = plan(shape, gpu, 4, 64, 64 * 8, top=5, optim="muon").ranked
    assert ranked and all(r["time"]["muon_ns_s"] > 0 and r["layout"]["offload"] == "none" for r in ranked)
    assert plan(shape, gpu, 4, 64, 64 * 8, fixed={"zero": 1, "offload": "optimizer"}).ranked
    with pytest.raises(PlanError, match="muon runs without optimizer offload"):
        plan(shape, gpu, 4, 64, 64 * 8, fixed={"zero": 1, "offload": "optimizer"}, optim="muon")
