"""Issue #13: the MoE model trains to one process's losses under expert parallelism and its compositions
(fp32, 1e-5 relative), capacity dropping included; the `moe` metrics agree across layouts."""
import functools
import json
import os
import tempfile

import pytest

from harness import assert_half_losses, assert_same_losses, make_config, reference, rows, run_layout
from test_checkpoint import RESHARD, _layout, _train

FP32 = 1e-5
MOE = {"model__preset": "moe-debug", "training__steps": 4}


CASES = [
    ("ep2", 2, {"parallel__dp": 2, "parallel__ep": 2}),
    ("ep4", 4, {"parallel__dp": 4, "parallel__ep": 4}),
    ("dp2-ep2-zero1", 4, {"parallel__dp": 4, "parallel__ep": 2, "parallel__zero": 1, "parallel__zero_group": 2}),
    ("dp4-ep2-zero3", 4, {"parallel__dp": 4, "parallel__ep": 2, "parallel__zero": 3}),
    ("dp4-ep2", 4, {"parallel__dp": 4, "parallel__ep": 2}),
    ("ep2-pp2", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__pp": 2}),
    ("ep2-pp2-gpipe", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__pp": 2, "parallel__pp_schedule": "gpipe"}),
    ("ep2-pp2-interleaved", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__pp": 2,
                                "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2}),
    ("ep2-pp2-zb-h1", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__pp": 2, "parallel__pp_schedule": "zb-h1"}),
    ("ep2-tp2", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__tp": 2}),
    ("ep2-tp2-sp", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__tp": 2, "parallel__sp": True}),
    ("ep2-ac-full-accum", 2, {"parallel__dp": 2, "parallel__ep": 2, "training__ac": "full", "training__micro_batch": 1}),
    ("ep2-ac-selective-zero2", 2, {"parallel__dp": 2, "parallel__ep": 2, "training__ac": "selective", "parallel__zero": 2}),
    # capacity dropping: decided per micro-batch at the source, so the same tokens drop as in one process
    ("ep2-cp2", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__cp": 2}),
    ("cp2-ulysses", 2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses"}),
    ("ep4-dp2-cp2-zero1", 4, {"parallel__dp": 2, "parallel__ep": 4, "parallel__cp": 2, "parallel__zero": 1}),
    ("ep2-bf16", 2, {"parallel__dp": 2, "parallel__ep": 2, "training__precision": "bf16"}),
    ("ep2-capacity", 2, {"parallel__dp": 2, "parallel__ep": 2, "model__moe__capacity_factor": 1.0}),
]


def assert_same_routing(ref: list[dict], got: list[dict]) -> None:
    """fp32: the routing metrics are global, the same in every layout (aux_loss to 1e-5, counts exactly).
    The counts are integers from top-k choices, not sums: they agree as long as no router score pair is
    within the layouts' fp32 rounding (~1e-6 relative) of a tie, which the bf16 rows below show is not
    guaranteed in general; for these seeded fp32 rows it holds on AMX, AVX-512 and AVX2 kernels alike."""
    for a, b in zip(ref, got):
        assert set(b["moe"]) == {"aux_loss", "tokens_per_expert_min", "tokens_per_expert_max", "dropped"}
        for k in ("tokens_per_expert_min", "tokens_per_expert_max", "dropped"):
            assert a["moe"][k] == b["moe"][k], (k, a["moe"], b["moe"])
        assert abs(a["moe"]["aux_loss"] - b["moe"]["aux_loss"]) <= FP32 * a["moe"]["aux_loss"]


def assert_bf16_routing_near(ref: list[dict], got: list[dict], exact: list[dict]) -> None:
    """bf16 (issue #45): rounding flips near-tie routing choices, and each flip moves aux_loss by a discrete
    step, so no fixed bound holds on every CPU (1e-3 did on AVX2; AMX kernels made ep2 3.0e-3 off at step 4).
    The bound comes from this test's own fp32 run (`exact`, equal to every fp32 layout within 1e-5): a bf16
    run strays from the exact routing by e (one process's bf16 vs fp32, its running max over the steps so
    far: measured 1.5e-5, 7.9e-4, 9.5e-4, 8.4e-3 at steps 1-4 with AMX kernels), and two bf16 runs that each
    stray that far are at most 2e apart. Measured ep2 vs one process: 0, 4.9e-5, 6.4e-4, 3.0e-3."""
    e = 0.0
    for a, b, x in zip(ref, got, exact):
        assert set(b["moe"]) == {"aux_loss", "tokens_per_expert_min", "tokens_per_expert_max", "dropped"}
        e = max(e, abs(a["moe"]["aux_loss"] - x["moe"]["aux_loss"]) / x["moe"]["aux_loss"])
        rel = abs(a["moe"]["aux_loss"] - b["moe"]["aux_loss"]) / a["moe"]["aux_loss"]
        assert rel <= 2 * e + FP32, f"step {a['step']}: aux_loss {b['moe']} vs one process {a['moe']} " \
                                    f"(rel {rel:.2e} > twice bf16's own distance from fp32, {e:.2e})"


@pytest.mark.parametrize("name,world,overrides", rows(CASES, {"ep2"}))  # ep2 also in `make test-fast`
def test_moe_layout_matches_one_process(pools, name, world, overrides):
    single = {**MOE, **{k: v for k, v in overrides.items() if not k.startswith("parallel__")}}
    ref = reference(**single)
    got = run_layout(pools, make_config(**MOE, **overrides), world)
    if overrides.get("training__precision") == "bf16":
        assert_half_losses(single, got)
        fp32 = {k: v for k, v in single.items() if k != "training__precision"}
        assert_bf16_routing_near(ref, got, reference(**fp32))
    else:
        assert_same_losses(ref, got, FP32)
        assert_same_routing(ref, got)
    if "capacity_factor" in str(overrides):
        assert all(m["moe"]["dropped"] > 0 for m in got), [m["moe"] for m in got]


CKPT = {"model__preset": "moe-debug"}


@functools.lru_cache(maxsize=None)
def _ckpt_reference() -> tuple:
    return tuple(_train(None, {}, tempfile.mkdtemp(prefix="meshlm-moe-ref-"), **CKPT))


@pytest.mark.parametrize("a,b", [("dp2 ep2 zero1", "1proc"), ("dp2", "dp4 ep2 zero3"), ("dp4 ep4", "dp2 ep2 pp2")],
                         ids=["ep2->ep1", "ep1->ep2-zero3", "ep4->ep2-pp2"])
def test_moe_checkpoint_reshards_across_ep(pools, a, b):
    """Expert weights are placed with a DimSplit over ep: a checkpoint of one ep degree resumes in
    another with one process's losses, nothing gathered (tests/test_checkpoint.py's harness)."""
    ref = list(_ckpt_reference())
    dir_a, dir_b = tempfile.mkdtemp(prefix="meshlm-a-"), tempfile.mkdtemp(prefix="meshlm-b-")
    _train(pools, _layout(a), dir_a, stop=4, checkpoint__every=4, checkpoint__keep=2, **CKPT)  # only step 4 is resumed
    step4 = os.path.join(dir_a, "checkpoints", "step_00000004")
    got = _train(pools, _layout(b), dir_b, checkpoint__resume=step4, **CKPT)
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    assert_same_losses(ref[4:], got, RESHARD)


def _eval_losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["eval_loss"] for line in f if '"eval_loss"' in line]


def test_moe_eval_under_ep(pools):
    """Held-out evaluation dispatches over ep too (no grad, no statistics): the eval losses of dp2 with
    and without ep2 (the eval batches depend on dp, so the reference is dp2, not one process)."""
    from harness import train_case
    from meshlm.core import config as C

    over = {**MOE, "training__steps": 2, "training__eval_every": 1, "training__eval_batches": 2, "parallel__dp": 2}
    ref_dir, got_dir = tempfile.mkdtemp(prefix="meshlm-ref-"), tempfile.mkdtemp(prefix="meshlm-ep-")
    pools(2).run(train_case, C.to_dict(make_config(**over)), ref_dir)
    pools(2).run(train_case, C.to_dict(make_config(**over, parallel__ep=2)), got_dir)
    want, got = _eval_losses(ref_dir), _eval_losses(got_dir)
    assert len(want) == 2 and len(got) == 2
    for a, b in zip(want, got):
        assert abs(a - b) <= FP32 * a, (want, got)
