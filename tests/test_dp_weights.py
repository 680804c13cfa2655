"""Uneven data parallelism, parallel.dp_weights (issue #51, docs/heterogeneous.md): bad input in one line
before any worker, the split of each global batch, and one-process losses (fp32, 1e-5 per step) for DDP,
ZeRO-1/3 and dp×tp under uneven weights, and a checkpoint moved between weights."""
import os
import tempfile

import numpy as np
import pytest
from harness import (assert_refused_in_one_line, assert_same_losses, make_config, read_metrics, reference, rows,
                     train_case, train_in)

from meshlm.core import config as C
from meshlm.data.sampler import GlobalBatchSampler
from harness import build_layout
from meshlm.plan.search.auto import layout_for_run

FP32 = 1e-5
STEPS = 6  # enough updates for a wrong average or a wrong slice to show in the loss


# ---------------------------------------------------------------- bad input, before launch

@pytest.mark.parametrize("overrides,world,message", [
    ({"parallel__dp_weights": [3, 0]}, 2, "parallel.dp_weights: every weight must be a positive integer, got [3, 0]"),
    ({"parallel__dp_weights": [-1, 2]}, 2, "parallel.dp_weights: every weight must be a positive integer, got [-1, 2]"),
    ({"parallel__dp_weights": [3, 1, 1]}, 2, "parallel.dp_weights: 3 weights for dp = 2 replicas (one per replica)"),
    ({"parallel__dp_weights": [2, 1]}, 2, ("parallel.dp_weights: [2, 1] split training.global_batch 8 into 5.33333, "
                                           "2.66667 sequences, not whole micro-batches of training.micro_batch 2 per replica")),
    ({"parallel__dp_weights": [3, 1], "parallel__microbatches": 3}, 2,
     "parallel.dp_weights: not with parallel.microbatches (it sets one count for every replica)"),
    ({"parallel__dp_weights": [3, 1], "parallel__pp": 2, "parallel__pp_schedule": "interleaved",
      "parallel__pp_virtual": 2, "model__n_layers": 4}, 4,
     ("parallel.dp_weights: replica 0 runs 3 micro-batches: parallel.microbatches: 'interleaved' needs "
      "micro-batches divisible by pp; 3 is not a multiple of 2")),
    ({"parallel__dp_weights": [3, 1], "parallel__auto": True}, 2,
     "parallel.dp_weights: not with parallel.auto (the planner chooses equal replicas)"),
    ({"parallel__dp_weights": [3, 1], "parallel__elastic": "replan"}, 2,
     "parallel.dp_weights: not with parallel.elastic = replan (the planner chooses equal replicas)"),
])
def test_bad_dp_weights_is_one_clear_line(overrides, world, message):
    """Through the trainer's entry (plan.auto.resolve: parallel.auto chooses before layout.build_layout)."""
    assert_refused_in_one_line(lambda: layout_for_run(make_config(**overrides), world), message)


def test_weights_split_the_batch_and_equal_weights_change_nothing():
    lay = build_layout(make_config(parallel__dp_weights=[3, 1]), 2)
    assert (lay.dp_accums, lay.dp_rows, lay.accum, lay.step_microbatches, lay.global_batch) == ((3, 1), (6, 2), 3, 4, 8)
    assert [lay.accum_of(r) for r in range(2)] == [3, 1] and lay.mean_accum == 2.0
    even = build_layout(make_config(parallel__dp=2), 2)
    assert (even.dp_accums, even.dp_rows, even.accum, even.mean_accum) == ((), (), 2, 2.0)
    # 6 sequences, micro-batches of 2, dp 2: 2:1 gives 4 + 2 (the even split needs 6 divisible by 4)
    assert build_layout(make_config(parallel__dp_weights=[2, 1], training__global_batch=6), 2).dp_accums == (2, 1)


def test_uneven_slices_are_one_process_batch_in_order():
    """Replica r reads the r-th contiguous run; the runs, in replica order, are one process's batch."""
    sampler = GlobalBatchSampler(10_000, 16, 8, seed=3)
    shards = np.arange(10_000, dtype=np.int64)

    class Flat:  # TokenShards' reads over a plain array
        def __len__(self):
            return len(shards)

        def get(self, start, n):
            return shards[start:start + n]

    for step in (0, 7):
        whole = sampler.batch(Flat(), step).inputs
        parts = [sampler.batch(Flat(), step, r, 2, rows=(6, 2)).inputs for r in range(2)]
        assert [p.shape[0] for p in parts] == [6, 2]
        assert (np.concatenate(parts) == whole.numpy()).all()
    with pytest.raises(ValueError, match="do not split global_batch 8"):
        sampler.batch(Flat(), 0, 0, 2, rows=(6, 1))


# ---------------------------------------------------------------- one-process losses

def assert_same_norms(ref: list[dict], got: list[dict]) -> None:
    for a, b in zip(ref, got):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=FP32), (a["step"], b["grad_norm"], a["grad_norm"])


CASES = [
    ("ddp-3-1", 2, {"parallel__dp_weights": [3, 1]}, {}),
    ("ddp-1-3", 2, {"parallel__dp_weights": [1, 3]}, {}),
    ("zero1-3-1", 2, {"parallel__zero": 1, "parallel__dp_weights": [3, 1]}, {}),
    ("zero2-1-3", 2, {"parallel__zero": 2, "parallel__dp_weights": [1, 3]}, {}),
    ("zero3-3-1", 2, {"parallel__zero": 3, "parallel__dp_weights": [3, 1]}, {}),
    ("dp2-tp2-2-1", 4, {"parallel__tp": 2, "parallel__dp_weights": [2, 1]}, {"training__global_batch": 6}),
    ("moe-ddp-3-1", 2, {"parallel__dp_weights": [3, 1]}, {"model__preset": "moe-debug"}),
    ("moe-zero1-1-3", 2, {"parallel__zero": 1, "parallel__dp_weights": [1, 3]}, {"model__preset": "moe-debug"}),
]


def _passes(trainer) -> tuple[int, int, int]:
    """(dp index, micro-batches, passes) of a rank's step runner: the padding is seen, not assumed."""
    return trainer.ctx.index("dp"), trainer.runner.accum, trainer.runner.passes


@pytest.mark.parametrize("name,world,layout,single", rows(CASES, slowest=["dp2-tp2-2-1", "ddp-1-3", "zero2-1-3",
                                                                             "moe-zero1-1-3"]))
def test_uneven_layout_matches_one_process(pools, name, world, layout, single):
    check_uneven_row(pools, world, layout, single)


def check_uneven_row(pools, world: int, layout: dict, single: dict) -> None:
    """Every update is the one-process update of the same global batch: the losses agree per step, so do
    the gradient norms (AdamW forgives a gradient scaled wrongly; the norm does not), and the metrics
    count the real tokens of the whole global batch; MoE's routing metrics and MTP's loss are one
    process's. DDP and ZeRO-1 run each replica's own count; ZeRO-2/3 and EP pad the lighter replica to
    the longest. `single`: the one-process run's own overrides (shared by tests/test_dp_weights_dims.py)."""
    cfg = make_config(training__steps=STEPS, **single, **layout)
    run_dir = tempfile.mkdtemp(prefix="meshlm-dpw-")
    seen = pools(world).run(train_case, C.to_dict(cfg), run_dir, 0, _passes)
    got = read_metrics(run_dir)
    ref = reference(training__steps=STEPS, **single)
    assert_same_losses(ref, got, FP32)
    assert_same_norms(ref, got)
    for key in ("moe", "mtp_loss"):  # the routing metrics (counts exactly; the aux loss to fp32), MTP's loss
        for a, b in zip(ref, got):
            assert b.get(key, {}) == pytest.approx(a.get(key, {}), rel=FP32), (key, a["step"], a.get(key), b.get(key))
    seqs = single.get("training__global_batch", 8)
    assert [r["tokens"] for r in got] == [r["step"] * seqs * 32 for r in got]
    lay = build_layout(cfg, world)
    assert seen == [(d, lay.accum_of(d), max(lay.accum_of(d), lay.dp_pad_to)) for d, _, _ in seen]
    assert {d for d, _, _ in seen} == set(range(lay.dp))


def test_checkpoint_under_weights_resumes_evenly_and_in_one_process(pools):
    check_resume(pools, 2, {}, {"parallel__dp": 2})


def check_resume(pools, world: int, layout: dict, even: dict) -> None:
    """Saved at step 3 under 3:1 (`layout` besides the weights); resumed under 1:1 (`even`) and in one
    process, steps 4-6 are the uninterrupted run's: the data position is the step, whatever the split."""
    ref = reference(training__steps=STEPS)
    first = tempfile.mkdtemp(prefix="meshlm-dpw-ckpt-")
    train_in(pools, make_config(training__steps=STEPS, checkpoint__every=3, parallel__dp_weights=[3, 1], **layout),
             world, first, stop=3)
    saved = os.path.join(first, "checkpoints", "step_00000003")
    for world, layout in ((world, even), (1, {})):
        out = tempfile.mkdtemp(prefix="meshlm-dpw-resume-")
        resumed = train_in(pools, make_config(training__steps=STEPS, checkpoint__resume=saved, **layout), world, out)
        assert [r["step"] for r in resumed] == list(range(4, STEPS + 1))
        assert_same_losses(ref[3:], resumed, FP32)
        assert_same_norms(ref[3:], resumed)
