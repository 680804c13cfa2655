"""Saving on preemption (train/resilience/preempt.py): a signal of checkpoint.on_signal that reaches one rank stops
every rank at the same step boundary with a checkpoint of that step and one line naming the signal
and the step; the resume from it gives the uninterrupted run's losses. A real `meshlm train --nproc 2`
whose worker, or whose launcher, gets SIGTERM exits 128 + 15 and says so."""
import os
import signal

import pytest
from harness import make_config, rows, train_hooked, train_in
from test_fault import assert_same_as, launch_until_logging, lines, workers

from meshlm.train.checkpoint import list_checkpoints
from meshlm.train.resilience.preempt import PREEMPTED_BASE, Preemption, exit_status

CASE = {"training__steps": 6, "checkpoint__resume": "auto"}
LAYOUTS = [("dp2", 2, {"parallel__dp": 2}), ("tp2xpp2", 4, {"parallel__tp": 2, "parallel__pp": 2})]


@pytest.mark.parametrize("name,world,layout", rows(LAYOUTS, fast=["dp2"]))
def test_signal_to_one_rank_saves_that_step_and_resumes(tmp_path, pools, name, world, layout):
    cfg = make_config(**CASE, **layout)
    ref = [r for r in train_in(pools, cfg, world, str(tmp_path / "ref")) if "loss" in r]
    run = str(tmp_path / "run")
    got = train_hooked(pools, cfg, world, run, {"MESHLM_TEST_SIGNAL": f"{world - 1}:3:SIGTERM"})
    stops = [r for r in got if "preempted" in r]
    assert [(r["step"], r["preempted"]) for r in stops] == [(3, "SIGTERM")], got
    assert max(r["step"] for r in got if "loss" in r) == 3
    assert [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))] == [3]
    train_hooked(pools, cfg, world, run, {})  # checkpoint.resume = "auto": from step 3
    assert_same_as(ref, run)


def test_handlers_are_put_back_and_agreement_reads_the_sum():
    before = signal.getsignal(signal.SIGUSR1)
    p = Preemption(["SIGUSR1"], __import__("torch").device("cpu"))
    assert float(p.flag()[0]) == 0.0
    os.kill(os.getpid(), signal.SIGUSR1)  # handled: the process goes on
    assert float(p.flag()[0]) == 1.0 and p.got == signal.SIGUSR1
    assert p.agreed(p.flag()) and not p.agreed(p.flag() * 0)
    p.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert exit_status("SIGTERM") == PREEMPTED_BASE + 15 == 143


@pytest.mark.slow
@pytest.mark.parametrize("target", ["worker", "launcher"])
def test_sigterm_to_one_worker_of_a_launch(tmp_path, target):
    """SIGTERM to rank 1's worker, or to the launcher, whose torchrun agent (in its own process,
    train/launch.py run_agent) passes it on to every worker: either way a preemption, exit 143."""
    run = tmp_path / "run"
    proc = launch_until_logging(run, ["--max-restarts", "1"], step_sleep=0.2)
    os.kill(workers(os.getpid())[1] if target == "worker" else proc.pid, signal.SIGTERM)
    err = proc.communicate(timeout=180)[1]
    assert proc.returncode == 143, err[-3000:]
    stop, = [r for r in lines(run) if "preempted" in r]
    assert stop["preempted"] == "SIGTERM" and 3 <= stop["step"] < 200, stop
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [stop["step"]]
    ours = [x for x in err.splitlines() if x.startswith("meshlm: ")]
    assert ours[-1] == f"meshlm: preempted by SIGTERM at step {stop['step']}, checkpoint saved", ours
    assert not [x for x in ours if "restart" in x], ours  # the launcher's torchrun did not restart it


def test_a_signal_to_one_island_stops_every_island_a_step_later(tmp_path, pools):
    """With DiLoCo islands the stop flag crosses them without waiting (parallel/dims/islands.py
    `agree_stop`): a signal to island 1's rank at step 3 stops both islands after step 4, with a
    checkpoint of step 4, and the resume gives the uninterrupted run's losses."""
    cfg = make_config(**CASE, parallel__islands=2, training__outer__sync_every=2)
    ref = [r for r in train_in(pools, cfg, 2, str(tmp_path / "ref")) if "loss" in r]
    run = str(tmp_path / "run")
    got = train_hooked(pools, cfg, 2, run, {"MESHLM_TEST_SIGNAL": "1:3:SIGTERM"})
    assert [(r["step"], r["preempted"]) for r in got if "preempted" in r] == [(4, "SIGTERM")], got
    assert [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))] == [4]
    train_hooked(pools, cfg, 2, run, {})
    assert_same_as(ref, run)
