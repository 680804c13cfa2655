"""optim.schedule (train/optim.py lr_at): each shape at its corners, today's cosine unchanged, and the bad
schedule keys refused in one line before any worker starts (docs/training.md)."""
import math

import pytest

from meshlm.core import config as C
from meshlm.cli import main
from meshlm.core.facts.course import lr_at


def opt(**kw) -> C.OptimConfig:
    return C.OptimConfig(**{"lr": 1.0, "warmup": 4, "min_lr_ratio": 0.1, **kw})


def test_cosine_is_the_function_of_before():
    """The default schedule is bit for bit the formula every existing run used."""
    o = opt()
    assert o.schedule == "cosine"
    for s in range(25):
        if s < 4:
            want = (s + 1) / 4
        else:
            p = min(1.0, (s - 4) / 16)
            want = 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * p))
        assert lr_at(s, o, 20) == want


def test_warmup_is_the_same_in_every_schedule():
    for sched in ("cosine", "wsd", "constant", "linear"):
        o = opt(schedule=sched, decay_steps=4 if sched == "wsd" else 0)
        assert [lr_at(s, o, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0], sched


def test_constant_and_linear():
    c, lin = opt(schedule="constant"), opt(schedule="linear")
    assert {lr_at(s, c, 20) for s in range(4, 40)} == {1.0}
    assert lr_at(4, lin, 20) == 1.0  # end of warmup: the peak
    assert lr_at(12, lin, 20) == pytest.approx(0.55)  # half way
    assert lr_at(19, lin, 20) == pytest.approx(0.1 + 0.9 / 16)  # the last step, one step short of the floor
    assert lr_at(20, lin, 20) == pytest.approx(0.1)


@pytest.mark.parametrize("kind,half", [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)])
def test_wsd_corners(kind, half):
    """100 steps, decay over the last 10: flat at lr to step 89, update k of 10 at progress k/10, the last
    step at the floor exactly."""
    o = opt(schedule="wsd", decay_steps=10, decay_type=kind)
    assert lr_at(4, o, 100) == 1.0  # end of warmup
    assert {lr_at(s, o, 100) for s in range(4, 90)} == {1.0}  # stable, up to the step before the decay
    assert lr_at(90, o, 100) < 1.0  # the decay's first update
    assert lr_at(94, o, 100) == pytest.approx(0.1 + 0.9 * half)  # progress 5/10
    assert lr_at(99, o, 100) == pytest.approx(0.1)  # the last step runs at lr × min_lr_ratio
    lrs = [lr_at(s, o, 100) for s in range(89, 100)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # strictly decreasing through the decay


def test_wsd_fraction_and_default():
    """decay_steps in (0, 1) is a fraction of training.steps; 0 means a fifth."""
    frac, default = opt(schedule="wsd", decay_steps=0.25), opt(schedule="wsd")
    assert lr_at(74, frac, 100) == 1.0 and lr_at(75, frac, 100) < 1.0  # 25 decay steps: 75..99
    assert lr_at(79, default, 100) == 1.0 and lr_at(80, default, 100) < 1.0  # 20: 80..99
    assert lr_at(99, frac, 100) == pytest.approx(0.1)


def test_wsd_decay_of_every_step_after_warmup_and_one_step():
    whole = opt(schedule="wsd", decay_steps=16, decay_type="linear")
    assert lr_at(4, whole, 20) == pytest.approx(1.0 - 0.9 / 16) and lr_at(19, whole, 20) == pytest.approx(0.1)
    one = opt(schedule="wsd", decay_steps=1)
    assert lr_at(18, one, 20) == 1.0 and lr_at(19, one, 20) == pytest.approx(0.1)


BAD = [
    (["--optim.schedule", "step"], "optim.schedule: 'step' is not one of cosine, wsd, constant, linear"),
    (["--optim.schedule", "wsd", "--optim.decay_type", "exp"], "optim.decay_type: 'exp' is not one of"),
    (["--optim.schedule", "wsd", "--optim.decay_steps", "19"], "optim.decay_steps: the decay (19 steps) is longer "
                                                               "than the steps after warmup (20 - 2 = 18)"),
    (["--optim.schedule", "wsd", "--optim.decay_steps", "2.5"], "optim.decay_steps: expected a whole number"),
    (["--optim.schedule", "wsd", "--optim.decay_steps", "-0.5"], "optim.decay_steps: expected a whole number"),
    (["--optim.decay_steps", "5"], "optim.decay_steps: only optim.schedule = wsd has a decay phase"),
    (["--training.z_loss", "-1e-4"], "training.z_loss: must be >= 0"),
    (["--optim.anneal_steps", "5"], "optim.anneal_steps: an anneal starts from a checkpoint"),
    (["--optim.anneal_steps", "5", "--checkpoint.resume", "never"], "optim.anneal_steps: an anneal starts from"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_schedule_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, argv, needle):
    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), "--model.preset", "debug", "--training.steps", "20",
                 "--optim.warmup", "2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert needle in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("argv,needle", BAD[:3], ids=[b[1][:40] for b in BAD[:3]])
def test_estimate_refuses_what_train_refuses(capsys, argv, needle):
    """`meshlm estimate` prices the run's schedule (its run line): a bad one is refused there the same way."""
    code = main(["estimate", "--gpu", "h100", "--gpus", "8", "--model.preset", "debug", "--training.steps", "20",
                 "--optim.warmup", "2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


# -- in training: the schedule survives a resume and every layout ------------------------------------
# TINY for 10 steps, warmup 2, the last 4 decaying to 0 (updates at steps 7..10; a checkpoint after step 7
# is in the middle of the decay)
WSD = dict(optim__schedule="wsd", optim__decay_steps=4, optim__decay_type="sqrt", optim__min_lr_ratio=0.0,
           training__steps=10)


def test_resume_in_the_middle_of_the_decay_is_identical(tmp_path):
    from harness import make_config, run_local
    cfg = make_config(checkpoint__every=7, checkpoint__keep=0, **WSD)
    ref = run_local(cfg, str(tmp_path / "a"))
    assert [r["lr"] for r in ref] == [lr_at(s, cfg.optim, 10) for s in range(10)]
    assert ref[5]["lr"] == cfg.optim.lr and ref[6]["lr"] == cfg.optim.lr / 2 and ref[-1]["lr"] == 0.0  # sqrt: 1 - √¼
    run_local(cfg, str(tmp_path / "b"), stop=7)
    resumed = run_local(make_config(checkpoint__every=7, checkpoint__resume="auto", **WSD), str(tmp_path / "b"))
    after = [r for r in resumed if r["step"] > 7]
    assert [r["step"] for r in after] == [8, 9, 10]
    for a, b in zip(ref[7:], after):
        assert (a["loss"], a["lr"]) == (b["loss"], b["lr"]), a["step"]  # exact


def test_wsd_dp2_zero3_equals_one_process_and_its_mid_decay_checkpoint_resumes_in_one(pools, tmp_path):
    """One multi-rank row: dp2 ZeRO-3 with WSD against one process (fp32, 1e-5 per step), then its
    checkpoint from the middle of the decay resumed by one process, equal to the uninterrupted run."""
    import os

    from harness import assert_same_losses, make_config, reference, run_local, train_in
    ref = reference(**WSD)
    run_dir = str(tmp_path / "dp2")
    got = train_in(pools, make_config(parallel__dp=2, parallel__zero=3, checkpoint__every=7, checkpoint__keep=0,
                                      **WSD), 2, run_dir)
    assert_same_losses(ref, got, 1e-5)
    assert [r["lr"] for r in got] == [r["lr"] for r in ref]
    ck = os.path.join(run_dir, "checkpoints", "step_00000007")
    resumed = [r for r in run_local(make_config(checkpoint__resume=ck, **WSD), str(tmp_path / "one")) if r["step"] > 7]
    assert [r["step"] for r in resumed] == [8, 9, 10]
    assert_same_losses(ref[7:], resumed, 1e-5)
