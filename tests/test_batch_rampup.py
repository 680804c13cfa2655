"""training.batch_rampup (issue 53, item 3; docs/training.md, "Batch-size ramp-up"): Megatron's --rampup-batch-size. The
batch sizes follow Megatron's rule, the sampler serves each step from its consumed-sample offset, the
ramp's first steps are a small-batch run's, every layout gives one process's losses, a run resumed in
the middle of the ramp is the uninterrupted run, bad ramps are one line before any worker, and the
planner prices the ramp's steps at their batch."""
import argparse
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from harness import assert_refused_in_one_line, assert_same_losses, make_config, run_local, train_in

from meshlm.core.facts.ramp import BatchRamp
from meshlm.data.sampler import GlobalBatchSampler, MixtureSampler, apportion

# TINY (global_batch 8) for 10 steps with micro-batches of 1 and the ramp 2 -> 8 in steps of 2 over 24
# samples: 4 steps of 2, 2 of 4, 2 of 6, then 8 (by hand: the level of c consumed samples is c·3 // 24)
# and WSD (warmup 2, flat, then a 6-step linear decay from step 4): step 5's checkpoint is mid-ramp and mid-decay
WSD = {"optim__schedule": "wsd", "optim__decay_steps": 6, "training__steps": 10}
RAMP = {"training__micro_batch": 1, "training__batch_rampup": [2, 2, 24], **WSD}
SIZES = [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]


def megatron_batch(consumed: int, start: int, inc: int, over: int, global_batch: int) -> int:
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update, as it reads (floats and all)."""
    n = (global_batch - start) // inc
    if n == 0 or consumed > over:
        return global_batch
    return min(global_batch, start + int(consumed / (over / n)) * inc) if over else global_batch


def test_batch_sizes_follow_megatron_and_the_levels_add_up():
    rng = np.random.default_rng(0)
    for _ in range(300):
        inc, start = int(rng.integers(1, 9)), int(rng.integers(1, 21))
        g, over = start + inc * int(rng.integers(0, 7)), int(rng.integers(0, 300))
        ramp, consumed = BatchRamp(g, [start, inc, over]), 0
        for step in range(200):
            want = megatron_batch(consumed, start, inc, over, g)
            assert (ramp.batch(step), ramp.consumed(step)) == (want, consumed), (start, inc, over, g, step)
            consumed += want
        assert sum(b * n for b, n in ramp.steps_at(200)) == ramp.consumed(200)
    ramp = BatchRamp(8, [2, 2, 24])
    assert [ramp.batch(s) for s in range(10)] == SIZES and ramp.ramp_steps == 8
    assert ramp.sizes() == [2, 4, 6, 8] and ramp.steps_at(10) == [(2, 4), (4, 2), (6, 2), (8, 2)]
    assert BatchRamp(8).levels == BatchRamp(8, [8, 2, 100]).levels and BatchRamp(8).consumed(7) == 56


def test_sampler_serves_each_step_from_its_consumed_offset():
    """Step t's windows are the stream's [consumed(t), consumed(t) + batch(t)); the steps together read
    the stream once, in order, as a batch-1 sampler does; without a ramp nothing moved."""
    ramped = GlobalBatchSampler(10_001, 16, 8, seed=3, rampup=[2, 2, 24])
    one = GlobalBatchSampler(10_001, 16, 1, seed=3)
    read = [w for s in range(10) for w in ramped.indices(s)]
    assert [len(ramped.indices(s)) for s in range(10)] == SIZES
    assert read == [w for s in range(len(read)) for w in one.indices(s)]
    fixed = GlobalBatchSampler(10_001, 16, 8, seed=3)
    assert fixed.indices(5) == fixed.order.take(40, 8).tolist() and fixed.state_dict() == {"step": 0}
    ramped.load_state_dict({"step": 5})
    assert ramped.state_dict() == {"step": 5, "samples": 12} and ramped.batch_size() == 4


class _Source:
    """A token stream whose every token of window w is k·10⁶ + w: a batch's first column names the
    source and window of each row."""

    def __init__(self, k: int, tokens: int, seq: int):
        self.k, self.tokens, self.seq = k, tokens, seq

    def __len__(self) -> int:
        return self.tokens

    def get(self, pos: int, count: int) -> np.ndarray:
        return np.full(count, self.k * 10**6 + pos // self.seq, dtype=np.int64)


def test_mixture_ramp_apportions_each_batch_and_walks_each_source_in_order():
    """data.mix under a ramp: each step's batch is apportioned between the sets like a full one, each
    set's windows over the steps are its own order read once, and dp ranks read slices of one batch."""
    seq, weights = 8, [0.75, 0.25]
    srcs = [_Source(0, 4001, seq), _Source(1, 2001, seq)]
    ms = MixtureSampler([len(s) for s in srcs], ["a", "b"], weights, seq, 8, seed=1, rampup=[2, 2, 24])
    seen: list[list[int]] = [[], []]
    for step, size in enumerate(SIZES):
        rows = ms.batch(srcs, step).inputs[:, 0].tolist()
        halves = [ms.batch(srcs, step, r, 2).inputs[:, 0].tolist() for r in range(2)]
        assert len(rows) == size and halves[0] + halves[1] == rows
        mine = [sorted(x % 10**6 for x in rows if x // 10**6 == k) for k in range(2)]
        assert [len(m) for m in mine] == apportion(size, weights)
        for k, part in enumerate(ms.parts):  # the next windows of set k's own order
            assert mine[k] == sorted(part.order.take(len(seen[k]), len(mine[k])).tolist())
            seen[k] += mine[k]
    ms.load_state_dict({"step": 10})
    assert ms.drawn() == {"a": len(seen[0]) * seq, "b": len(seen[1]) * seq}
    assert sum(ms.drawn().values()) == seq * sum(SIZES)


def _copy_truncated(src: str, keep_step: int) -> str:
    """A copy of run `src` as if it had stopped right after checkpoint `keep_step`."""
    dst = tempfile.mkdtemp(prefix="meshlm-ramp-resume-")
    shutil.copytree(os.path.join(src, "checkpoints", f"step_{keep_step:08d}"),
                    os.path.join(dst, "checkpoints", f"step_{keep_step:08d}"))
    with open(os.path.join(src, "metrics.jsonl")) as f, open(os.path.join(dst, "metrics.jsonl"), "w") as g:
        g.writelines(x for x in f if json.loads(x)["step"] <= keep_step)
    return dst


_REF: dict = {}


def ramp_reference() -> tuple[list[dict], str]:
    """One process with the ramp (checkpoint every 5 steps: step 5 is in the middle of the ramp), once."""
    if not _REF:
        run_dir = tempfile.mkdtemp(prefix="meshlm-ramp-ref-")
        _REF["run"] = (run_local(make_config(**RAMP, checkpoint__every=5, checkpoint__keep=0), run_dir), run_dir)
    return _REF["run"]


def test_one_process_ramp_is_a_small_batch_run_then_resumes_exactly():
    """While the batch is 2, the ramp is bit for bit a global_batch 2 run (the same windows, the mean over
    the step's tokens, the LR of the step); metrics.jsonl shows each step's batch and counts its tokens;
    a run resumed from step 5 (batch 4, mid-ramp) logs the uninterrupted run's losses exactly."""
    ref, run_dir = ramp_reference()
    small = run_local(make_config(training__micro_batch=1, training__global_batch=2, **WSD))
    assert [r["loss"] for r in ref[:4]] == [r["loss"] for r in small[:4]]
    assert ref[4]["loss"] != small[4]["loss"]  # step 5 reads 4 sequences
    assert [r["global_batch"] for r in ref] == SIZES and "global_batch" not in small[0]
    assert [r["tokens"] for r in ref] == [32 * sum(SIZES[:s + 1]) for s in range(10)]
    assert [r["lr"] for r in ref] == [r["lr"] for r in small]  # the schedule counts steps
    assert ref[3]["lr"] == ref[2]["lr"] > ref[4]["lr"] > ref[5]["lr"] > ref[9]["lr"]  # flat, then decaying
    with open(os.path.join(run_dir, "checkpoints", "step_00000005", "meta.json")) as f:
        assert json.load(f)["sampler"] == {"step": 5, "samples": 12}
    resumed_dir = _copy_truncated(run_dir, 5)
    resumed = run_local(make_config(**RAMP, checkpoint__resume="auto"), resumed_dir)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [(r["loss"], r["global_batch"]) for r in resumed[5:]] == [(r["loss"], r["global_batch"]) for r in ref[5:]]


LAYOUTS = [
    ("dp2-zero3", 2, {"parallel__dp": 2, "parallel__zero": 3}),
    ("tp2-pp2", 4, {"parallel__tp": 2, "parallel__pp": 2}),
]


@pytest.mark.parametrize("name,world,layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_ramp_layout_matches_one_process(pools, name, world, layout):
    """Each replica runs batch/(dp·micro_batch) micro-batches a step (ZeRO-3 gathers per micro-batch);
    the pipeline runs a schedule of 2, 4, 6 then 8 micro-batches: fp32 losses within 1e-5 of one
    process's with the same ramp, the same batch logged. The layout's mid-ramp checkpoint (step 5)
    resumes in the other layout of the pair (one process, or dp2 ZeRO-3) on the same losses."""
    ref, ref_dir = ramp_reference()
    run_dir = tempfile.mkdtemp(prefix=f"meshlm-ramp-{name}-")
    got = train_in(pools, make_config(**RAMP, **layout, checkpoint__every=5, checkpoint__keep=0), world, run_dir)
    assert [r["global_batch"] for r in got] == SIZES
    assert_same_losses(ref, got, 1e-5)
    if name == "dp2-zero3":  # resharded mid-ramp: dp2 ZeRO-3 -> one process, one process -> dp2 ZeRO-3
        resumed = run_local(make_config(**RAMP, checkpoint__resume="auto"), _copy_truncated(run_dir, 5))
        assert_same_losses(ref, resumed, 1e-5)
        back = train_in(pools, make_config(**RAMP, **layout, checkpoint__resume="auto"), world,
                        _copy_truncated(ref_dir, 5))
        assert_same_losses(ref, back, 1e-5)


BAD = [
    ({"training__batch_rampup": [2, 2]}, ("training.batch_rampup: expected [start_sequences, increment, "
                                          "over_sequences], got [2, 2]")),
    ({"training__batch_rampup": [16, 2, 8]}, ("training.batch_rampup: the start batch 16 is larger than "
                                              "training.global_batch 8")),
    ({"training__batch_rampup": [2, 0, 8]}, "training.batch_rampup: the increment must be > 0, got 0"),
    ({"training__batch_rampup": [2, 2, -8]}, "training.batch_rampup: the ramp's samples must be >= 0, got -8"),
    ({"training__batch_rampup": [2, 4, 8]}, ("training.batch_rampup: the increment 4 does not divide "
     "training.global_batch - start = 8 - 2 (Megatron's rule: the ramp ends exactly at the global batch)")),
    ({"training__batch_rampup": [2, 2, 8], "parallel__elastic": "replan"},
     ('training.batch_rampup: not with parallel.elastic = "replan" (the planner would pick a batch split the '
      "ramp's sizes may not divide)")),
    ({"training__batch_rampup": [2, 2, 8], "parallel__dp_weights": [3, 1]},
     "training.batch_rampup: not with parallel.dp_weights (the uneven split is fixed for one global batch)"),
]


@pytest.mark.parametrize("over,message", BAD, ids=[m.split(": ", 1)[1][:30] for _, m in BAD])
def test_bad_ramp_is_one_line(over, message):
    assert_refused_in_one_line(lambda: make_config(**over).check(), message)


def test_ramp_that_does_not_split_is_refused_before_any_worker(tmp_path, capsys):
    """The first batch size that is not whole micro-batches per replica is named, exit 2, nothing written;
    an elastic resize whose dp the ramp's sizes do not divide is refused the same way."""
    from meshlm.cli import main
    from meshlm.plan.search.auto import layout_for_run

    def resolve(cfg, world, restarts=0):  # the entry's layout
        return layout_for_run(cfg, world, restarts=restarts)[0]

    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), "--model.preset", "debug", "--nproc", "2",
                 "--training.global_batch", "8", "--training.micro_batch", "1", "--training.batch_rampup", "2,3,12"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not run_dir.exists()
    assert err == ("meshlm: training.batch_rampup: a step of 5 sequences does not split into whole micro-batches "
                   "of micro_batch×dp = 1×2"), err
    cfg = make_config(**RAMP)  # dp = -1: 2, 4, 6, 8 split over 2 replicas, not over 4
    assert resolve(cfg, 2, restarts=1).dp == 2
    assert_refused_in_one_line(lambda: resolve(make_config(**RAMP), 4, restarts=1),
                               "training.batch_rampup: a step of 2 sequences does not split into whole micro-batches "
                               "of micro_batch×dp = 1×4 (after an elastic resize to 4 ranks; parallel.elastic = "
                               "\"replan\" lets the planner pick a layout that fits)")
    # DiLoCo islands split each step like dp: 2, 4, 6, 8 over 2 islands of one rank, each step's mean over its
    # island's share (Layout.step_accum); a start of 3 is not whole micro-batches per island
    islands = resolve(make_config(**RAMP, parallel__islands=2, parallel__dp=1), 2)
    assert [islands.step_accum(b) for b in (2, 4, 8)] == [1, 2, 4]
    assert_refused_in_one_line(
        lambda: resolve(make_config(**{**RAMP, "training__batch_rampup": [3, 1, 10]}, parallel__islands=2,
                                    parallel__dp=1), 2),
        "training.batch_rampup: a step of 3 sequences does not split into whole micro-batches of "
        "micro_batch×dp×islands = 1×1×2")
    interleaved = {**RAMP, "training__batch_rampup": [3, 1, 10], "parallel__pp": 2, "parallel__pp_virtual": 2,
                   "parallel__pp_schedule": "interleaved", "model__n_layers": 4}  # 3 micro-batches over pp 2
    assert_refused_in_one_line(lambda: resolve(make_config(**interleaved), 2),
                               "parallel.microbatches: 'interleaved' needs micro-batches divisible by pp; 3 is "
                               "not a multiple of 2")


def _estimate(capsys, tmp_path, *argv) -> tuple[int, str]:
    from meshlm.plan import cli as cli_cmds
    p = argparse.ArgumentParser(prog="meshlm")
    cli_cmds.add_parsers(p.add_subparsers(dest="command", required=True))
    args, extra = p.parse_known_args(["estimate", "--gpu", "h100", "--gpus", "2", "--model.preset", "debug",
                                      "--data.seq_len", "256", "--training.steps", "10", "--training.micro_batch",
                                      "1", "--parallel.dp", "2", "--training.precision", "bf16", *argv])
    code = args.func(args, extra)
    return code, capsys.readouterr().out


def test_estimate_prices_the_ramp_steps_at_their_batch(capsys, tmp_path):
    """The run total is each batch's step time (the estimate of a run with that global batch) times its
    steps, by hand: 4 steps of 2, 2 of 4, 2 of 6, 2 of 8; the ramp's cost is the run's time over its 44
    sequences at the full batch's rate."""
    step = {}
    for b in (2, 4, 6, 8):
        code, out = _estimate(capsys, tmp_path, "--training.global_batch", str(b), "--json")
        assert code == 0 and "run" not in json.loads(out)
        step[b] = json.loads(out)["step_s"]
    code, out = _estimate(capsys, tmp_path, "--training.global_batch", "8", "--training.batch_rampup", "2,2,24",
                          "--json")
    run = json.loads(out)["run"]
    total = 4 * step[2] + 2 * step[4] + 2 * step[6] + 2 * step[8]
    assert run["seconds"] == pytest.approx(total, rel=1e-12) and run["ramp_steps"] == 8
    assert run["tokens"] == 44 * 256
    assert run["ramp_extra"] == pytest.approx(total / (44 / 8 * step[8]) - 1, rel=1e-12)
    assert step[2] > step[8] / 4  # a small batch is dearer per sequence: the ramp costs more than its tokens
    assert run["ramp_extra"] > 0
    code, text = _estimate(capsys, tmp_path, "--training.global_batch", "8", "--training.batch_rampup", "2,2,24")
    assert (f"\nrun: 10 steps, {total / 3600:.3g} h (ramp: first 8 steps at smaller batches, "
            f"{run['ramp_extra']:+.1%})\n") in text + "\n"  # the energy line follows it (docs/energy.md)
    code, text = _estimate(capsys, tmp_path, "--training.global_batch", "8")
    assert f"\nrun: 10 steps, {10 * step[8] / 3600:.3g} h\n" in text + "\n"
    code, _ = _estimate(capsys, tmp_path, "--training.global_batch", "8", "--training.batch_rampup", "2,3,24")
    assert code == 2


def test_calibration_reads_the_full_batch_steps_of_a_ramped_run(tmp_path):
    """--calibrate prices the run's layout at the full batch: a ramped run's smaller steps are left out
    (warm-up is counted from the first full-batch line)."""
    from meshlm.plan.calibrate.fit import PlanError, measured

    lines = [{"step": s + 1, "step_s": 0.1 * b / 8 + 0.01 * s, "global_batch": b, "comm": {}}
             for s, b in enumerate(SIZES + [8, 8, 8])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert measured(str(tmp_path)).step_s == pytest.approx(0.1 + 0.01 * 11)  # steps 11-13 of 9-13
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:10]))
    with pytest.raises(PlanError, match="has 2 logged steps at the full batch"):
        measured(str(tmp_path))
