"""Elastic resizes (docs/fault_tolerance.md): a checkpoint written on one world resumes on another with
the global batch and the data position kept (shrink, replan when the layout no longer fits, grow back),
every loss equal to an uninterrupted run; the restart line names the old and new world and layout; a
rank whose heartbeat stops is named within parallel.heartbeat_s; parallel.elastic = "fail" refuses
with one line."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fault_plugin import plugin_env
from harness import hooked_case, make_config, run_local, train_hooked
from meshlm.core import config as C
from meshlm.core.config import ConfigError

CASE = dict(training__steps=12, checkpoint__every=4, checkpoint__keep=10, checkpoint__resume="auto",
            parallel__elastic="replan")


def keep_checkpoints_upto(run: str, step: int) -> None:
    """The job was lost after checkpoint `step`: later checkpoints never happened."""
    root = os.path.join(run, "checkpoints")
    for name in os.listdir(root):
        if int(name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(os.path.join(root, name))


@pytest.mark.slow
def test_shrink_replan_and_grow_keep_every_loss(pools, tmp_path):
    ref = {r["step"]: r["loss"] for r in run_local(make_config(**CASE))}
    run = str(tmp_path / "run")
    train_hooked(pools, make_config(**CASE, parallel__tp=2), 2, run, {})  # tp 2 on 2 ranks
    keep_checkpoints_upto(run, 4)
    # one rank left: tp 2 cannot fit, the planner picks a layout of 1 rank; resumes from step 4
    train_hooked(pools, make_config(**CASE, parallel__tp=2), 1, run, {"TORCHELASTIC_RESTART_COUNT": "1"})
    keep_checkpoints_upto(run, 8)
    # the node is back: 2 ranks again (data parallel, ZeRO-1), resumes from step 8
    lines = train_hooked(pools, make_config(**CASE, parallel__zero=1), 2, run, {"TORCHELASTIC_RESTART_COUNT": "2"})
    got = [r for r in lines if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, 13)), "a step is missing or logged twice"
    for r in got:
        assert abs(r["loss"] - ref[r["step"]]) <= 1e-5 * ref[r["step"]], (r["step"], r["loss"], ref[r["step"]])
    restarts = [r for r in lines if "restart" in r]
    assert [(r["resumed_from"], r["old_world"], r["world"]) for r in restarts] == [(4, 2, 1), (8, 1, 2)]
    assert restarts[0]["old_layout"]["tp"] == 2 and restarts[0]["layout"]["tp"] == 1
    assert restarts[1]["layout"]["dp_shard"] == 2 and all(r["resized"] for r in restarts)
    # the global batch (8) stays: micro-batch 2 × accumulation × dp
    assert restarts[0]["old_accum"] == 4 and restarts[1]["accum"] == 2


def test_grown_job_agrees_on_one_restart_count(pools, tmp_path):
    """Growing back with the returning node's worker as rank 0: its agent counts from 0, the survivor's
    has restarted twice. Every rank takes the largest count before the layout and the resume, so both
    resume from step 4 although checkpoint.resume = "never", rank 0 writes the restart line, both
    replan the 1-rank layout (dp 1) to the same 2-rank one, and every loss is one process's."""
    cfg = make_config(training__steps=8, checkpoint__every=4, checkpoint__keep=10, checkpoint__resume="never",
                      parallel__dp=1, parallel__elastic="replan")
    run = str(tmp_path / "run")
    ref = {r["step"]: r["loss"] for r in train_hooked(pools, cfg, 1, run, {}) if "loss" in r}  # uninterrupted
    keep_checkpoints_upto(run, 4)
    counts = [{"TORCHELASTIC_RESTART_COUNT": "0"}, {"TORCHELASTIC_RESTART_COUNT": "2"}]
    ranks = pools(2).run(hooked_case, C.to_dict(cfg), run, counts, timeout=300)  # ranks that disagree hang
    assert [r["restarts"] for r in ranks] == [2, 2]
    assert [r["resumed_from"] for r in ranks] == [4, 4]
    assert ranks[0]["layout"] == ranks[1]["layout"] and ranks[0]["accum"] == ranks[1]["accum"], ranks
    with open(os.path.join(run, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    restarts = [r for r in lines if "restart" in r]
    assert [(r["restart"], r["resumed_from"], r["old_world"], r["world"]) for r in restarts] == [(2, 4, 1, 2)]
    assert restarts[0]["layout"] == ranks[0]["layout"] and restarts[0]["old_layout"]["dp_shard"] == 1
    got = [r for r in lines if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, 9)), "a step is missing or logged twice"
    for r in got:
        assert abs(r["loss"] - ref[r["step"]]) <= 1e-5 * ref[r["step"]], (r["step"], r["loss"], ref[r["step"]])


def test_layout_that_no_longer_fits():
    from meshlm.plan.search.auto import layout_for_run
    cfg = make_config(parallel__tp=2, parallel__elastic="fail", model__n_layers=4)  # pp 3 needs 3 blocks or more
    with pytest.raises(ConfigError) as e:
        layout_for_run(cfg, 3)  # a first launch: the usual line
    assert "elastic" not in str(e.value), e.value
    with pytest.raises(ConfigError) as e:
        layout_for_run(cfg, 3, restarts=1)  # the job's agreed restart count (distributed/mesh.py join_world)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("parallel") and 'parallel.elastic = "replan"' in msg, msg
    cfg = make_config(parallel__tp=2, parallel__elastic="replan", model__n_layers=4)
    layout, record = layout_for_run(cfg, 3)
    assert layout.tp * layout.dp * layout.pp * layout.cp == 3
    assert record["replanned_from"] == "tp 2" and not cfg.parallel.auto
    assert layout.micro_batch * layout.accum * layout.dp == 8  # the global batch is kept


def test_silent_rank_is_named_within_the_heartbeat():
    import torch.distributed as dist

    from meshlm.distributed.watchdog import Watchdog
    store = dist.HashStore()
    said = []
    alive = Watchdog(store, 2, 3, silent_s=60)  # rank 2 keeps beating
    store.set("meshlm/alive/1", "3:0")  # rank 1 stamped once, then its node was lost
    t0 = time.monotonic()
    watch = Watchdog(store, 0, 3, silent_s=2.0, on_silent=said.append)
    watch.step = 5
    while not said and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    waited = time.monotonic() - t0
    alive.close()
    watch.close()
    assert len(said) == 1 and said[0].startswith("rank 0: lost rank 1 (silent 2 s) at step 5"), said
    assert "rank 2" not in said[0]
    assert 2.0 < waited < 10, waited


AGENT_CASE = {**{k.replace("__", "."): v for k, v in CASE.items() if k != "parallel__elastic"},
              "training.steps": 20, "checkpoint.every": 2, "parallel.dp": -1, "parallel.zero": 1,
              "parallel.heartbeat_s": 5, "parallel.timeout_s": 60}


def agent(node: int, port: int, run: str, log: str) -> subprocess.Popen:
    """One torchrun agent of an elastic job of 1 to 2 nodes (one worker each) on loopback; node 0's
    agent hosts the rendezvous store (it starts first), so node 1 is the one that may be lost."""
    from harness import TINY
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
            "--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
            "--max-restarts=3", "--monitor-interval=0.5",
            "-m", "meshlm.cli", "train", "--run-dir", run]
    for k, v in {**TINY, **AGENT_CASE}.items():
        args += [f"--{k}", str(v)]
    # Steps sleep 0.3 s so the kill lands a step or two after checkpoint 4; the shrunk job on one rank
    # holds after step 16 (tests/fault_plugin.py) until node 1 is back, so it cannot end first.
    # Each round's rank 0 publishes the workers' store address anew: with the shared store (torch's
    # default) an agent that was rank 0 before does not, and a node joining later waits forever.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               **plugin_env(MESHLM_TEST_STEP_SLEEP="0.3", MESHLM_TEST_HOLD_ALONE="16", MESHLM_TEST_NODE=node_mark(node)))
    return subprocess.Popen(args, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def node_mark(node: int) -> str:
    return f"{os.getpid()}-{node}"


def kill_node(node: int) -> None:
    """SIGKILL the agent and the workers of `node` (torchrun starts workers in sessions of their own,
    so they are found by the mark in their environment)."""
    mark = f"MESHLM_TEST_NODE={node_mark(node)}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def wait_for(pred, procs, deadline: float, what: str):
    while not pred():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"an agent ended while waiting for {what}"
        time.sleep(0.1)
    return time.time()


@pytest.mark.slow
def test_node_lost_and_back_with_two_agents(tmp_path):
    """Two agents, node 1 SIGKILLed (agent and worker) after the step-4 checkpoint: node 0 goes on alone
    from step 4; node 1 is started again and the job grows back to 2 ranks; every loss is one process's."""
    from harness import _free_port
    run, port = str(tmp_path / "run"), _free_port()
    a0 = agent(0, port, run, str(tmp_path / "a0.log"))
    time.sleep(1)  # node 0 hosts the rendezvous store; node 1 joins within the first round's last call
    a1 = agent(1, port, run, str(tmp_path / "a1.log"))
    deadline = time.time() + 500

    def lines_():
        p = os.path.join(run, "metrics.jsonl")
        return [json.loads(x) for x in open(p) if x.strip()] if os.path.isfile(p) else []
    try:
        wait_for(lambda: os.path.isfile(os.path.join(run, "checkpoints", "step_00000004", "meta.json")),
                 [a0, a1], deadline, "checkpoint 4")
        kill_node(1)
        lost = time.time()
        a1.wait()
        shrunk = wait_for(lambda: any(r.get("restart") and r.get("world") == 1 for r in lines_()), [a0], deadline,
                          "the restart on 1 rank")
        resumed = wait_for(lambda: "loss" in lines_()[-1], [a0], deadline, "a step on 1 rank")
        print(f"node lost -> restart line on 1 rank {shrunk - lost:.1f} s, -> its first step {resumed - lost:.1f} s",
              flush=True)
        a1 = agent(1, port, run, str(tmp_path / "a1b.log"))
        back = time.time()
        grown = wait_for(lambda: any(r.get("restart") and r.get("world") == 2 and r.get("old_world") == 1
                                     for r in lines_()), [a0, a1], deadline, "the restart on 2 ranks")
        assert a0.wait(timeout=deadline - time.time()) == 0 and a1.wait(timeout=60) == 0
    finally:
        for node in (0, 1):
            kill_node(node)
    print(f"node back -> restart line on 2 ranks {grown - back:.1f} s")
    lines = lines_()
    restarts = [r for r in lines if "restart" in r]
    assert [(r["old_world"], r["world"]) for r in restarts] == [(2, 1), (1, 2)], restarts
    assert restarts[0]["resumed_from"] >= 4
    ref = {r["step"]: r["loss"] for r in run_local(make_config(**{k.replace(".", "__"): v for k, v in AGENT_CASE.items()
                                                                     if not k.startswith("parallel.")}))}
    got = [r for r in lines if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, 21))
    for r in got:
        assert abs(r["loss"] - ref[r["step"]]) <= 1e-5 * ref[r["step"]], (r["step"], r["loss"], ref[r["step"]])


def test_a_rank_that_left_is_not_lost():
    """A rank whose training ended (or failed with its own error) closes its watchdog: not 'lost'."""
    import torch.distributed as dist

    from meshlm.distributed.watchdog import Watchdog
    store, said = dist.HashStore(), []
    done = Watchdog(store, 1, 2, silent_s=60)
    deadline = time.monotonic() + 30
    while not store.check(["meshlm/alive/1"]):  # it stamped (its first beat comes one period in)
        assert time.monotonic() < deadline, "rank 1's watchdog never stamped"
        time.sleep(0.02)
    done.close()
    watch = Watchdog(store, 0, 2, silent_s=1.0, on_silent=said.append)
    time.sleep(3.5)  # rank 0 judges at 0.2, 1.2, 2.2 s: an unchanged live stamp is silent by the third (+1.3 s)
    watch.close()
    assert said == []
