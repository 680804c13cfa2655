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
    _free_port,
    assert_refused_in_one_line,
    assert_same_losses,
    make_config,
    read_metrics,
    train_in,
)

from meshlm.distributed import link
from meshlm.distributed.membership import Coordinator

ROUNDS = 4


def _member(island: int, port: int, die: dict, out: str) -> None:
    """One island's rank at place 0: ROUNDS rounds; each all-reduces (island + 1, 1) over the members and
    writes the members and the sum it committed with to `out`. `die`: round -> "before" | "inside". A later
    start of the island (incarnation 2) meets the others in their last round, which they hold until the
    coordinator took it back in (epoch 2)."""
    os.environ.update({link.ENV_STORE: f"127.0.0.1:{port}", link.ENV_ISLAND: str(island), link.ENV_ISLANDS: "3"})
    lk = link.Link(link.connect(30), island, 0, 30.0, link.LinkComm("islands", [island], island))
    for r in range(0 if lk.incarnation == 1 else ROUNDS - 1, ROUNDS):
        if die.get(r) == "before":
            os._exit(3)
        while r == ROUNDS - 1 and lk.incarnation == 1 and lk.epoch() < 2:
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
    lk.finish()
    lk.comm.release()


def _launcher(tmp_path, die: dict) -> list[list]:
    """The launcher's part (train/island_jobs.py, in small): island 2 out when its process ends; once
    islands 0 and 1 committed round 2, island 2 started again: it asks to join and the coordinator takes it in."""
    ctx = mp.get_context("spawn")
    store = link.connect(30, is_master=True)
    coordinator = Coordinator(store, 3, lost_after_s=60)
    out = [str(tmp_path / f"island{k}.jsonl") for k in range(3)]
    procs = {k: ctx.Process(target=_member, args=(k, store.port, die if k == 2 else {}, out[k])) for k in range(3)}
    for p in procs.values():
        p.start()

    def rounds(k: int) -> list[list]:
        return [json.loads(x) for x in open(out[k])] if os.path.exists(out[k]) else []
    deadline, restarted = time.time() + 120, False
    while procs and time.time() < deadline:
        coordinator.poll()
        for k, p in list(procs.items()):
            if p.exitcode is not None:
                del procs[k]
                coordinator.out(k)
        if not restarted and 2 not in procs and all(len(rounds(k)) == 3 for k in (0, 1)):
            procs[2] = ctx.Process(target=_member, args=(2, store.port, {}, out[2]))
            procs[2].start()
            restarted = True
        time.sleep(0.02)
    assert not procs, "a member did not finish in time"
    assert all(store.check([f"finished/{k}"]) for k in range(3))  # each said it finished (out, not lost)
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


def test_bad_island_job_input_is_one_line(tmp_path, capsys):
    from harness import build_layout
    from meshlm import preflight
    assert_refused_in_one_line(lambda: build_layout(make_config(training__outer__on_island_loss="sometimes"), 1),
                               "training.outer.on_island_loss: 'sometimes' is not one of stop, continue")
    cfg = make_config(training__outer__on_island_loss="continue")
    with pytest.raises(ValueError, match="^training.outer.on_island_loss: continue needs parallel.islands > 1$"):
        preflight._check_island_jobs(cfg, worker=False)
    cfg = make_config(parallel__islands=2, training__outer__on_island_loss="continue")
    with pytest.raises(ValueError, match="^training.outer.on_island_loss: continue runs one job per island: start "
                                         "it with meshlm's launcher"):
        preflight._check_island_jobs(cfg, worker=True)
    from meshlm.cli import main
    assert main(["train", "--link-server", "0", "--parallel.islands", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("meshlm: --link-server: serves island jobs: set parallel.islands > 1 "
                                               "and training.outer.on_island_loss = continue")


def _losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


JOB = {"training.steps": 12, "training.device": "cpu", "parallel.islands": 2, "training.outer.sync_every": 2,
       "checkpoint.every": 2, "checkpoint.resume": "auto"}


def _train(run_dir, nproc: int, inside: dict, kill: str | None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", str(nproc), "--max-restarts", "1",
            "--run-dir", str(run_dir)]
    for k, v in {**TINY, **JOB, "training.outer.on_island_loss": "continue", **inside}.items():
        args += [f"--{k}", str(v)]
    faults = {"MESHLM_TEST_KILL_AT": kill, "MESHLM_TEST_HOLD_FOR_ISLAND": "1:8"} if kill else {}
    env = dict(os.environ, OMP_NUM_THREADS="1", **plugin_env(**faults))
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
    step 5 (island 0 holds before step 8 until the launcher started island 1 again, so that the run does not
    end first on a fast machine): island 0 never restarts, logs every step once, equal to the run without a fault up to step 6
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


@pytest.mark.slowest  # a link server and three island launches by hand (~60 s)
def test_islands_started_by_other_schedulers_meet_over_a_link_server(tmp_path):
    """Islands that meshlm's launcher does not start (one scheduler per data centre, here the test): `meshlm
    train --link-server PORT` coordinates; each island is a torchrun with MESHLM_ISLAND / MESHLM_ISLANDS /
    MESHLM_LINK. Island 1 SIGKILLs itself at step 5 and its scheduler starts it again: it asks to join, is
    taken in (its old start counted out then), and rejoins; both finish with the same θ_outer."""
    port = _free_port()
    over = {**TINY, **JOB, "training.outer.on_island_loss": "continue", "parallel.timeout_s": 60}
    flags = [x for k, v in over.items() for x in (f"--{k}", str(v))]
    base = dict(os.environ, OMP_NUM_THREADS="1")
    logs = {}

    def start(name: str, args: list[str], env: dict) -> subprocess.Popen:
        logs[name] = tmp_path / f"{name}.log"  # a file, not a pipe: nobody blocks on a full one
        with open(logs[name], "a") as f:
            return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=f)

    server = start("server", [sys.executable, "-m", "meshlm.cli", "train", "--link-server", str(port), *flags], base)

    def island(k: int, faults: dict) -> subprocess.Popen:
        env = dict(base, **plugin_env(**faults), MESHLM_ISLAND=str(k), MESHLM_ISLANDS="2",
                   MESHLM_LINK=f"127.0.0.1:{port}")
        return start(f"island{k}", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                                    "-m", "meshlm.cli", "train", "--run-dir", str(tmp_path / "run"), "--worker", *flags],
                     env)
    first = island(0, {"MESHLM_TEST_HOLD_FOR_ISLAND": "1:8"})
    lost = island(1, {"MESHLM_TEST_KILL_AT": "1:5"})
    assert lost.wait(timeout=300) != 0
    again = island(1, {})
    codes = {name: p.wait(timeout=300) for name, p in (("island0", first), ("island1", again), ("server", server))}
    outs = {name: (codes[name], logs[name].read_text()) for name in codes}
    assert all(code == 0 for code, _ in outs.values()), {k: [x for x in v[1].splitlines() if "meshlm" in x][-8:]
                                                         for k, v in outs.items()}
    assert "meshlm: island 1 is back (start 2): it rejoins at the other islands' next outer sync" in outs["server"][1]
    assert "islands that finished: [0, 1]" in outs["server"][1]
    assert "meshlm: island 1 rejoined at step " in outs["island1"][1]
    run = tmp_path / "run"
    assert [s for s, _ in _losses(run)] == list(range(1, 13))
    mine, theirs = _outer(str(run / "checkpoints" / "step_00000012")), \
        _outer(str(run / "checkpoints" / "island1" / "step_00000012"))
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
