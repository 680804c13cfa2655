"""Losing an island without a restart (issue #52, docs/diloco.md "Losing an island"): the link's rounds
(distributed/link.py) average over the islands that are there, go on when one dies before or inside a
round, and take a restarted island in at the next round with the donor's state; `meshlm train` with
training.outer.on_island_loss = "continue" survives an island's SIGKILL and the island rejoins."""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch
from fault_plugin import plugin_env
from harness import (
    TINY,
    assert_refused_in_one_line,
    assert_same_losses,
    make_config,
    read_metrics,
    train_in,
)

from meshlm.distributed import link

ROUNDS = 4


def _member(island: int, port: int, admitted: int | None, die: dict, out: str) -> None:
    """One island's rank at place 0: ROUNDS rounds; each all-reduces (island + 1, 1) over the members and
    writes the members and the sum it committed with to `out`. `die`: round -> "before" | "inside". Before
    the last round the members wait for the launcher to take island 2 back (epoch 2)."""
    os.environ.update({link.ENV_STORE: f"127.0.0.1:{port}", link.ENV_ISLAND: str(island), link.ENV_ISLANDS: "3"})
    if admitted is not None:
        os.environ[link.ENV_ADMITTED] = str(admitted)
    store = link.connect(30)
    lk = link.Link(store, island, 0, 30.0, link.LinkComm("islands", [island], island))
    first = 0 if admitted is None else ROUNDS - 1  # a rejoining island meets the others in their last round
    for r in range(first, ROUNDS):
        if die.get(r) == "before":
            os._exit(3)
        while r == ROUNDS - 1 and admitted is None and lk.epoch() < 2:
            time.sleep(0.01)
        got = {}

        def round_fn(comm, r=r, got=got):
            if die.get(r) == "inside":
                os._exit(3)  # the others are in the collective already, or about to be
            t = torch.tensor([float(island + 1), 1.0])
            comm.all_reduce(t)

            def commit():
                got["sum"] = t.tolist()
            return commit
        members = lk.run(round_fn)
        with open(out, "a") as f:
            f.write(json.dumps([island, r, members, got["sum"]]) + "\n")


def _launcher(tmp_path, die: dict) -> list[list]:
    """The launcher's part (train/island_jobs.py, in small): a new epoch without island 2 when it dies; once
    islands 0 and 1 committed round 2, island 2 started again, admitted from epoch 2."""
    ctx = mp.get_context("spawn")
    store = link.connect(30, is_master=True)
    members = link.Membership(store, 3)
    out = [str(tmp_path / f"island{k}.jsonl") for k in range(3)]
    procs = {k: ctx.Process(target=_member, args=(k, store.port, None, die if k == 2 else {}, out[k]))
             for k in range(3)}
    for p in procs.values():
        p.start()

    def rounds(k: int) -> list[list]:
        return [json.loads(x) for x in open(out[k])] if os.path.exists(out[k]) else []
    deadline, restarted = time.time() + 120, False
    while procs and time.time() < deadline:
        for k, p in list(procs.items()):
            if p.exitcode is not None:
                del procs[k]
                members.change(sorted(procs))
        if not restarted and 2 not in procs and all(len(rounds(k)) == 3 for k in (0, 1)):
            procs[2] = ctx.Process(target=_member, args=(2, store.port, members.change([0, 1, 2]), {}, out[2]))
            procs[2].start()
            restarted = True
        time.sleep(0.02)
    assert not procs, "a member did not finish in time"
    return sorted(x for k in range(3) for x in rounds(k))


@pytest.mark.parametrize("when", ["before", "inside"])
def test_rounds_go_on_without_a_lost_island_and_take_it_back(tmp_path, when):
    """Island 2 dies at round 1 (before it, or inside its collective): islands 0 and 1 commit round 1 and on
    with each other only (sum 1 + 2 = 3 over 2 members); island 2, started again, is in the last round."""
    got = _launcher(tmp_path, {1: when})
    by = {(i, r): (m, s) for i, r, m, s in got}
    assert by[(0, 0)] == by[(1, 0)] == by[(2, 0)] == ([0, 1, 2], [6.0, 3.0])
    for r in (1, 2):
        assert by[(0, r)] == by[(1, r)] == ([0, 1], [3.0, 2.0]), got
    assert by[(0, 3)] == by[(1, 3)] == by[(2, 3)] == ([0, 1, 2], [6.0, 3.0]), got
    assert len(got) == 3 + 2 + 2 + 3


def test_bad_island_job_input_is_one_line(tmp_path):
    from meshlm.layout import resolve
    from meshlm.train import preflight
    assert_refused_in_one_line(lambda: resolve(make_config(training__outer__on_island_loss="sometimes"), 1),
                               "training.outer.on_island_loss: 'sometimes' is not one of stop, continue")
    cfg = make_config(training__outer__on_island_loss="continue")
    with pytest.raises(ValueError, match="^training.outer.on_island_loss: continue needs parallel.islands > 1$"):
        preflight._check_island_jobs(cfg, worker=False)
    cfg = make_config(parallel__islands=2, training__outer__on_island_loss="continue")
    with pytest.raises(ValueError, match="^training.outer.on_island_loss: continue runs one job per island: start "
                                         "it with meshlm's launcher"):
        preflight._check_island_jobs(cfg, worker=True)


def _losses(run_dir) -> list[tuple[int, float]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


JOB = {"training.steps": 12, "training.device": "cpu", "parallel.islands": 2, "training.outer.sync_every": 2,
       "checkpoint.every": 2, "checkpoint.resume": "auto"}


def _train(run_dir, nproc: int, inside: dict, kill: str | None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", str(nproc), "--max-restarts", "1",
            "--run-dir", str(run_dir)]
    for k, v in {**TINY, **JOB, "training.outer.on_island_loss": "continue", **inside}.items():
        args += [f"--{k}", str(v)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **plugin_env(**({"MESHLM_TEST_KILL_AT": kill} if kill else {})))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)


def _outer(path: str) -> dict[str, torch.Tensor]:
    from meshlm.train import checkpoint as ckpt
    md = ckpt.read_metadata(path)
    names = [k for k in md.state_dict_metadata if k.startswith(("outer/param/", "master/"))]
    return {k: ckpt.read_full(path, md, k) for k in names}


@pytest.mark.slowest  # two launches of two island jobs (~45 s, ~70 s with dp2 ZeRO-3 inside)
@pytest.mark.parametrize("nproc,inside", [(2, {}), (4, {"parallel.zero": 3})], ids=["one-rank", "dp2-zero3"])
def test_an_island_killed_mid_run_is_dropped_and_rejoins_without_a_restart(tmp_path, pools, nproc, inside):
    """Without a fault, island jobs give the one-job run's losses. Island 1's last rank SIGKILLs itself at
    step 5: island 0 never restarts, logs every step once, equal to the run without a fault up to step 6
    (its outer step at 4 had island 1's Δ), and finishes. Island 1 is started again, resumes from its own
    checkpoint (step 4), takes island 0's state at a later outer sync and finishes too: at step 12 (an outer
    sync) both islands hold the same θ_outer and masters."""
    ref = _train(tmp_path / "ref", nproc, inside, None)
    assert ref.returncode == 0, ref.stderr[-3000:]
    one_job = make_config(**{k.replace(".", "__"): v for k, v in {**JOB, **inside}.items()})
    assert_same_losses(train_in(pools, one_job, nproc, str(tmp_path / "one-job")), read_metrics(tmp_path / "ref"), 1e-6)
    run = tmp_path / "run"
    got = _train(run, nproc, inside, f"{nproc - 1}:5")
    assert got.returncode == 0, got.stderr[-3000:]
    err = got.stderr
    assert "meshlm: island 1 lost (its torchrun exited" in err
    assert "meshlm: island 1 restarting (1 of 1)" in err
    assert "meshlm: island 1 rejoined at step " in err and "(it was at step 4)" in err, err[-3000:]
    assert "threads alive after the teardown" not in err
    steps = _losses(run)
    assert [s for s, _ in steps] == list(range(1, 13)), "island 0 restarted or lost a step"
    assert steps[:6] == _losses(tmp_path / "ref")[:6]
    assert steps[6:] != _losses(tmp_path / "ref")[6:]  # island 1 missed at least one outer step
    mine, theirs = _outer(str(run / "checkpoints" / "step_00000012")), \
        _outer(str(run / "checkpoints" / "island1" / "step_00000012"))
    assert mine.keys() == theirs.keys() and len(mine) > 2
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    with open(run / "metrics.jsonl") as f:
        assert not [r for r in map(json.loads, f) if "restart" in r]
