"""Surviving failures (train/resilience/fault.py): a worker SIGKILLed mid-run under `--max-restarts` and one killed
while a checkpoint is half written both end in exit 0 with the uninterrupted run's losses; a NaN
loss stops bf16 with one line and leaves the last good checkpoint newest; checkpoint.every = "auto"
picks the Young/Daly interval from the measured save time."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from fault_plugin import plugin_env
from harness import TINY, make_config, run_layout, run_local

from meshlm.cli import main


def lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def launch(run_dir, nproc: int, overrides: dict, env: dict) -> subprocess.Popen:
    args = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", str(nproc), "--max-restarts", "2",
            "--run-dir", str(run_dir)]
    for k, v in {**TINY, **overrides}.items():
        args += [f"--{k}", str(v)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **plugin_env(**env))
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def workers(agent_parent: int) -> dict[int, int]:
    """rank -> pid of the training workers under our launcher (found through /proc)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        marker = f"MESHLM_TEST_OWNER={agent_parent}".encode()
        if marker in env and b"--worker" in cmd:
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank:
                out[int(rank[0][5:])] = int(pid)
    return out


def assert_same_as(ref: list[dict], run_dir: str) -> None:
    got = [r for r in lines(run_dir) if "loss" in r]
    assert [r["step"] for r in got] == [r["step"] for r in ref], "a step is missing or logged twice"
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a["step"], a["loss"], b["loss"])


CASE = {"checkpoint.every": 2, "checkpoint.keep": 10, "training.micro_batch": 1, "checkpoint.resume": "auto"}


@pytest.mark.slowest  # a launch that restarts (the suite's second-longest item after the exit soak): `make test-slow`
def test_sigkilled_worker_restarts_and_resumes(tmp_path, pools):
    ref = run_layout(pools, make_config(**{k.replace(".", "__"): v for k, v in CASE.items()}), 2)
    run = tmp_path / "run"
    owner = str(os.getpid())
    proc = launch(run, 2, CASE, {"MESHLM_TEST_STEP_SLEEP": "0.3", "MESHLM_TEST_OWNER": owner})
    done = run / "checkpoints" / "step_00000004" / "meta.json"
    deadline = time.time() + 240
    while not done.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    pids = workers(os.getpid())
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    restarts = [r for r in lines(run) if "restart" in r]
    assert len(restarts) == 1 and restarts[0]["restart"] == 1 and restarts[0]["resumed_from"] >= 4, restarts
    assert_same_as(ref, str(run))


@pytest.mark.slowest  # a launch that restarts (third-longest): `make test-slow`
def test_kill_during_checkpoint_write_uses_the_previous_one(tmp_path):
    ref = run_local(make_config(training__steps=8, **{k.replace(".", "__"): v for k, v in CASE.items()}))
    run = tmp_path / "run"
    proc = launch(run, 2, {**CASE, "training.steps": 8}, {"MESHLM_TEST_KILL_IN_SAVE": "6:1"})
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    restarts = [r for r in lines(run) if "restart" in r]
    assert [r["resumed_from"] for r in restarts] == [4], restarts  # not the half-written step 6
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    assert_same_as(ref, str(run))


@pytest.mark.slow
def test_saving_steps_line_survives_a_crash_after_the_save(tmp_path):
    """A saving step's metrics line is written after its save (it carries `ckpt`); a crash in between
    loses it, and the resume from that checkpoint puts it back from meta.json, once."""
    run = str(tmp_path / "run")
    base = dict(checkpoint__every=4, checkpoint__keep=5, metrics__every=1)
    run_local(make_config(training__steps=4, **base), run)
    meta = json.load(open(os.path.join(run, "checkpoints", "step_00000004", "meta.json")))
    kept = lines(run)
    step4 = [r for r in kept if r["step"] == 4 and "loss" in r][0]
    assert meta["metrics"]["loss"] == step4["loss"] and "ckpt" in step4
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:  # the crash: step 4's line never written
        f.writelines(json.dumps(r) + "\n" for r in kept if r["step"] < 4)
    run_local(make_config(training__steps=6, checkpoint__resume="auto", **base), run)
    got = [r for r in lines(run) if "loss" in r]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert got[3]["loss"] == step4["loss"]


@pytest.mark.slow
def test_nan_loss_stops_bf16_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHLM_PLUGINS", "fault_plugin")
    monkeypatch.setenv("MESHLM_TEST_NAN_STEP", "7")
    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run)]
    for k, v in {**TINY, "training.steps": 10, "checkpoint.every": 2, "checkpoint.keep": 10, "metrics.every": 3,
                 "training.precision": "bf16"}.items():
        argv += [f"--{k}", str(v)]
    assert main(argv) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("meshlm:")]
    assert err[0].startswith(f"meshlm: debug, 1 worker, precision bf16, compile off, run dir {run}; energy "), err
    assert err[1:] == ["meshlm: rank 0: non-finite loss at step 7: stopped (newest checkpoint: step 6; "
                       "lower optim.lr or check the data, then run again)"], err
    # step 7 is not a logged step (every 3): the check before step 8's save caught it
    assert sorted(os.listdir(run / "checkpoints"))[-1] == "step_00000006"
    assert max(r["step"] for r in lines(run)) == 6


def test_fp16_keeps_skipping_instead(tmp_path, monkeypatch):
    """fp16: a non-finite gradient norm is the loss scaler's business (skipped step), not a stop."""
    import torch

    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.train.resilience.fault import FiniteGuard
    ctx = init_context({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}, pick_device("cpu"))
    for precision, stops in (("fp16", False), ("bf16", True), ("fp32", True)):
        g = FiniteGuard(precision, torch.device("cpu"), ctx.comm("world"), str(tmp_path))
        g.observe(3, torch.tensor(2.0), torch.tensor(float("inf")))
        if stops:
            with pytest.raises(RuntimeError, match="non-finite gradient norm at step 3"):
                g.check(None)
        else:
            g.check(None)


@pytest.mark.slow
def test_auto_cadence_is_young_daly(tmp_path):
    run = str(tmp_path / "run")
    run_local(make_config(training__steps=14, checkpoint__every="auto", checkpoint__mtbf_hours=0.002,
                          checkpoint__keep=20), run)
    rec = [r for r in lines(run) if "checkpoint_every" in r]
    assert len(rec) == 1 and rec[0]["step"] == 5
    r = rec[0]
    expect = max(1, round(math.sqrt(2 * r["checkpoint_cost_s"] * 0.002 * 3600) / r["step_s"]))
    assert r["checkpoint_every"] == expect
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(os.path.join(run, "checkpoints")))
    assert steps == [s for s in range(5, 15) if (s - 5) % expect == 0]


def test_bad_fault_tolerance_input(tmp_path, capsys):
    run = tmp_path / "run"
    for argv, key in ((["--max-restarts", "-1"], "--max-restarts"),
                      (["--checkpoint.every", "auto"], "checkpoint.mtbf_hours"),
                      (["--checkpoint.every", "often"], "checkpoint.every")):
        assert main(["train", "--run-dir", str(run), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"meshlm: {key}") and "\n" not in err, err
    assert not run.exists()


def frozen_case() -> str:
    """Both ranks beat the same step and run two all-reduces; rank 1 then freezes before the third."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from meshlm.distributed.comm import CollectiveError, Comm
    from meshlm.distributed.watchdog import Watchdog
    rank, world = dist.get_rank(), dist.get_world_size()
    # 8 s: long enough for the group's creation and first all-reduces on a loaded machine (3 s once failed)
    comm = Comm("dp", dist.new_group(list(range(world)), timeout=timedelta(seconds=8)), list(range(world)), rank)
    comm.watchdog = Watchdog.for_job(rank, world)
    comm.watchdog.beat(3)
    try:
        for _ in range(2):
            comm.all_reduce(torch.ones(4))
        if rank == 1:  # frozen past rank 0's 8 s timeout; its record stays in the store after that
            time.sleep(9)
            return ""
        comm.all_reduce(torch.ones(4))
        return "no error"
    except CollectiveError as e:
        return str(e)
    finally:
        comm.watchdog.close()


def test_flight_recorder_names_the_rank_that_never_entered(pools):
    msg = pools(2).run(frozen_case)[0]
    assert msg.startswith("rank 0: all_reduce on group 'dp'"), msg
    assert "rank 1 never entered all_reduce #3 on group 'dp' (last reported: all_reduce #2 on 'dp' at step 3" in msg, msg


@pytest.mark.slow
def test_frozen_worker_is_named_by_the_launcher(tmp_path):
    run = tmp_path / "run"
    proc = launch_until_logging(run, ["--parallel.timeout_s", "6"], step_sleep=0.1)
    deadline = time.time() + 240
    pid = workers(os.getpid())[1]
    os.kill(pid, signal.SIGSTOP)  # a hung GPU or a stuck file read
    t0 = time.time()
    try:
        while not (run / "logs" / "error_rank0.txt").exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        waited = time.time() - t0
    finally:
        os.kill(pid, signal.SIGCONT)  # lets the agent's SIGTERM end it
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1
    assert 4 < waited < 40, waited  # about parallel.timeout_s
    ours = [x for x in err.splitlines() if x.startswith("meshlm: ")]
    rank0 = [x for x in ours if x.startswith("meshlm: rank 0: ")]
    assert rank0 and "rank 1 never entered" in rank0[-1] and "on group '" in rank0[-1], ours
    assert ours[-1].startswith("meshlm: training failed (exit 1); worker logs in"), ours


def launch_until_logging(run, extra: list[str], step_sleep: float) -> subprocess.Popen:
    """A 200-step `meshlm train --nproc 2` of TINY in `run` (each step slowed by the fault plugin), returned
    once 3 metrics lines are written, so a test can act on a job that is mid-run."""
    args = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", "2", "--run-dir", str(run),
            "--training.steps", "200", *extra]
    for k, v in TINY.items():
        args += [f"--{k}", str(v)] if k != "training.steps" else []
    env = dict(os.environ, OMP_NUM_THREADS="1",
               **plugin_env(MESHLM_TEST_OWNER=str(os.getpid()), MESHLM_TEST_STEP_SLEEP=str(step_sleep)))
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").exists() or len(lines(run)) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return proc
