"""Pipeline runtime (issue #5): stage partitioning, the measured trace and bubble, eval, checkpoints.
Loss equivalence of every schedule is in test_equivalence.py."""
import json
import os
import tempfile

import pytest
from harness import make_config, read_metrics, run_layout, run_local

from meshlm.core import config as C
from harness import build_layout
from meshlm.core.model_args import PRESETS
from meshlm.core.schedule.trace import load_timeline
from meshlm.core.schedule import build_schedule, p2p_batches
from meshlm.core.schedule.stage import StageCosts, estimate_costs, partition


# -- partitioning -------------------------------------------------------------------------------------
def test_partition_balances_blocks_and_head():
    assert partition(4, 2) == [[0, 1], [2, 3]]
    assert partition(8, 8) == [[i] for i in range(8)]
    assert partition(6, 4) == [[0, 1], [2, 3], [4], [5]]
    # a heavy head takes blocks away from the last stage
    assert [len(s) for s in partition(8, 2, StageCosts(head=2.0))] == [5, 3]
    assert [len(s) for s in partition(8, 2, StageCosts(embed=2.0))] == [3, 5]
    # Llama-3-8B, pp = 4: the 128k-vocabulary head is worth ~2.4 blocks
    costs = estimate_costs(PRESETS["llama3-8b"])
    assert 2.0 < costs.head < 3.0
    assert [len(s) for s in partition(32, 4, costs)] == [9, 9, 8, 6]


def test_partition_override_and_errors():
    assert partition(4, 2, override=[1, 3]) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="sums to 3"):
        partition(4, 2, override=[1, 2])
    with pytest.raises(ValueError, match="2 entries for 4 stages"):
        partition(4, 4, override=[2, 2])
    with pytest.raises(ValueError, match="at least one block"):
        partition(4, 2, override=[0, 4])
    with pytest.raises(ValueError, match="cannot fill"):
        partition(3, 4)


@pytest.mark.parametrize("overrides,world,match", [
    ({"parallel__pp": 2, "parallel__pp_layers": [1, 2]}, 2, "parallel.pp_layers: .* sums to 3"),
    ({"parallel__pp": 2, "parallel__pp_layers": [4]}, 2, "parallel.pp_layers: 1 entries for 2 stages"),
    ({"parallel__pp": 4, "model__n_layers": 3}, 4, "parallel.pp: 3 layers cannot fill"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "interleaved"}, 2, "parallel.pp_virtual: .* needs >= 2"),
    ({"parallel__pp": 2, "parallel__pp_virtual": 2, "model__n_layers": 4}, 2,
     "parallel.pp_virtual: schedule '1f1b' runs one chunk"),
    ({"parallel__pp_virtual": 2}, 1, "parallel.pp_virtual: 2 chunks per rank need pp > 1"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "zbv"}, 2, "parallel.pp_virtual: schedule 'zbv' runs exactly 2"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "dualpipe"}, 2, "parallel.pp_schedule: 'dualpipe' is not one of"),
    ({"parallel__pp": 4, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2, "model__n_layers": 8,
      "training__micro_batch": 4}, 4, "parallel.microbatches: .* divisible by pp"),
])
def test_layout_refuses_bad_pipelines(overrides, world, match):
    with pytest.raises(C.ConfigError, match=match) as e:
        build_layout(make_config(**overrides), world)
    assert "\n" not in str(e.value)


def test_layout_accepts_pipelines():
    lay = build_layout(make_config(parallel__pp=2, parallel__pp_layers="1,3", model__n_layers=4), 2)
    assert (lay.pp, lay.microbatches) == (2, 4)
    lay = build_layout(make_config(parallel__pp=2, parallel__dp=2, parallel__tp=2), 8)
    assert (lay.pp, lay.dp, lay.tp, lay.microbatches) == (2, 2, 2, 2)


# -- the zero-bubble backward split ------------------------------------------------------------------
@pytest.mark.parametrize("split", [True, False])
def test_split_backward_matches_plain_backward(split):
    """I then W gives bit-identical gradients to one backward; the split W never reruns the input chain
    (the attention core sits on it: its backward runs in I only)."""
    import dataclasses

    import torch

    from meshlm.model import PRESETS, Llama
    from meshlm.parallel.dims.pipeline.backward import input_backward
    from meshlm.parallel.dims.pipeline.runtime import Stage
    from meshlm.parallel.model_plans.llama import LLAMA_PLAN

    torch.manual_seed(0)
    model = Llama(dataclasses.replace(PRESETS["debug"], n_layers=3))
    model.tok_embeddings = None
    del model.layers["0"]
    stage = Stage(model, LLAMA_PLAN, ["1", "2"], 1, first=False, last=True)
    params = stage.parameters()
    y = torch.randint(0, 256, (2, 16))
    x0 = torch.randn(2, 16, 64)
    fired = []
    for block in model.layers.values():
        block.attention.core.register_full_backward_hook(lambda *a: fired.append(1))

    def loss():
        x = x0.clone().requires_grad_(True)
        return x, torch.nn.functional.cross_entropy(stage(x, 16).flatten(0, 1), y.flatten()) * 0.25

    x, out = loss()
    out.backward()
    ref, ref_x = [p.grad.clone() for p in params], x.grad.clone()
    for p in params:
        p.grad = None
    x, out = loss()
    fired.clear()
    gx, state = input_backward(out, None, x, params, split=split)
    assert len(fired) == 2 and x.grad is None and all(p.grad is None for p in params)
    assert (state.groups is not None) == split
    state.weight()
    assert len(fired) == (2 if split else 4)
    assert torch.equal(gx, ref_x)
    assert all(torch.equal(p.grad, r) for p, r in zip(params, ref))


# -- a real run: trace, bubble, eval, report, checkpoint ----------------------------------------------
PP2 = dict(parallel__pp=2, parallel__pp_schedule="1f1b", training__steps=4, training__eval_every=2,
           checkpoint__every=2)


@pytest.fixture(scope="module")
def pp2_run(pools):
    run_dir = tempfile.mkdtemp(prefix="meshlm-pp-")
    pools(2).run(_train, C.to_dict(make_config(**PP2)), run_dir)
    return run_dir


def _train(cfg_dict, run_dir):
    from harness import train_case
    return train_case(cfg_dict, run_dir)


def _all_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_trace_and_bubble(pp2_run):
    recs = read_metrics(pp2_run)
    assert len(recs) == 4
    for r in recs:
        assert 0.0 <= r["bubble"] < 1.0
    with open(os.path.join(pp2_run, "pipeline_trace.json")) as f:
        trace = json.load(f)
    meta = trace["otherData"]
    assert (meta["schedule"], meta["p"], meta["m"], meta["step"]) == ("1f1b", 2, 4, 4)
    assert meta["bubble"] == pytest.approx(recs[-1]["bubble"])
    actions = build_schedule("1f1b", 2, 4)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for r in range(2):
        mine = sorted((e for e in spans if e["tid"] == r), key=lambda e: e["ts"])
        items = p2p_batches(actions[r])
        assert len(mine) == len(items)
        # executed in list order, each item after the previous one
        for ev, it in zip(mine, items):
            if isinstance(it, tuple):
                assert ev["cat"] == "p2p" and ev["args"]["ops"] == [str(a) for a in it]
            else:
                assert (ev["args"]["kind"], ev["args"]["mb"]) == (it.kind, it.mb)
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))
    tl, blocked = load_timeline(os.path.join(pp2_run, "pipeline_trace.json"))
    assert tl.p == 2 and sum(len(r) for r in tl.rows) == 2 * 8 and len(blocked) == 2
    assert tl.bubble == pytest.approx(meta["bubble"], abs=1e-6)


def test_eval_matches_one_process(pp2_run):
    ref_dir = tempfile.mkdtemp(prefix="meshlm-ref-")
    cfg = make_config(**{k: v for k, v in PP2.items() if not k.startswith("parallel__")})
    run_local(cfg, ref_dir)
    ev = lambda d: [r["eval_loss"] for r in _all_records(d) if "eval_loss" in r and "loss" not in r]
    ref, got = ev(ref_dir), ev(pp2_run)
    assert len(ref) == len(got) == 2
    for a, b in zip(ref, got):
        assert b == pytest.approx(a, rel=1e-5)


def test_report_draws_pipeline(pp2_run):
    from meshlm.cli import main
    assert main(["report", pp2_run]) == 0
    assert os.path.getsize(os.path.join(pp2_run, "pipeline.png")) > 1000


def test_checkpoint_from_pp2_resumes_in_one_process(pp2_run):
    """A pp=2 checkpoint (each stage wrote its own parameters) loads into one process, which then
    continues exactly as an uninterrupted single-process run."""
    ckpt = os.path.join(pp2_run, "checkpoints", "step_00000002")
    assert os.path.isfile(os.path.join(ckpt, "meta.json"))
    base = {k: v for k, v in PP2.items() if not k.startswith("parallel__")}
    base.update(training__eval_every=0, checkpoint__every=0)
    ref = run_local(make_config(**base))
    resumed = run_local(make_config(**base, checkpoint__resume=ckpt))
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(ref[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_one_process_checkpoint_resumes_in_pp2(pools):
    base = dict(training__steps=4, training__eval_every=0)
    run_dir = tempfile.mkdtemp(prefix="meshlm-ref-")
    ref = run_local(make_config(**base, checkpoint__every=2), run_dir)
    ckpt = os.path.join(run_dir, "checkpoints", "step_00000002")
    got = run_layout(pools, make_config(**base, parallel__pp=2, parallel__pp_schedule="zb-h1",
                                        checkpoint__resume=ckpt), 2)
    assert [r["step"] for r in got] == [3, 4]
    for a, b in zip(ref[2:], got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_zero1_reduces_once_per_step(pools):
    """dp=2 × pp=2 with ZeRO-1: each of rank 0's units (embedding, two blocks) is reduce-scattered
    once per step, not once per micro-batch."""
    got = run_layout(pools, make_config(parallel__dp=2, parallel__pp=2, parallel__zero=1, training__steps=2,
                                        model__n_layers=4), 4)  # two blocks on stage 0
    for r in got:
        assert r["comm"]["reduce_scatter"]["calls"] == 3
