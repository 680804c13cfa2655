"""Trainer behaviour: exact resume, portable checkpoints, fp16 skipping, our DDP against torch DDP,
named hangs, and real torchrun launches (one agent with --nproc, two agents as two 'nodes')."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import pytest
import torch
from harness import assert_same_losses, make_config, read_metrics, run_local

from meshlm.core import config as C


def truncate_run(run_dir: str, keep_step: int) -> None:
    """Make a finished run look as if it had stopped right after checkpoint `keep_step`."""
    root = os.path.join(run_dir, "checkpoints")
    for name in os.listdir(root):
        if int(name.split("_")[1]) > keep_step:
            shutil.rmtree(os.path.join(root, name))
    path = os.path.join(run_dir, "metrics.jsonl")
    lines = [line for line in open(path) if json.loads(line)["step"] <= keep_step]
    open(path, "w").writelines(lines)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_gives_identical_losses(tmp_path, precision):
    cfg = make_config(checkpoint__every=5, checkpoint__keep=5, training__precision=precision, training__steps=10)
    ref = run_local(cfg, str(tmp_path / "a"))
    run_local(cfg, str(tmp_path / "b"))
    truncate_run(str(tmp_path / "b"), 5)
    resumed = run_local(make_config(checkpoint__every=5, checkpoint__keep=5, checkpoint__resume="auto",
                                    training__precision=precision, training__steps=10), str(tmp_path / "b"))
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for a, b in zip(ref[5:], resumed[5:]):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])  # exact


def test_checkpoint_from_dp2_resumes_in_one_process(pools):
    """docs/architecture.md invariant 3 for data parallelism, through an atomic rename with pruning of old ones."""
    from harness import train_case
    cfg = make_config(parallel__dp=2, checkpoint__every=3, checkpoint__keep=2, training__micro_batch=1, training__steps=10)
    run_dir = tempfile.mkdtemp(prefix="meshlm-ckpt-")
    pools(2).run(train_case, C.to_dict(cfg), run_dir)
    ref = read_metrics(run_dir)
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ckpts == ["step_00000006", "step_00000009"]  # keep=2 pruned step 3; no .tmp left behind
    truncate_run(run_dir, 6)
    resumed = run_local(make_config(checkpoint__resume="auto", training__micro_batch=1, training__steps=10), run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert_same_losses(ref[6:], resumed[6:], 1e-5)


def test_fp16_overflow_skips_step_and_backs_off(tmp_path):
    from meshlm.distributed.mesh import init_context, pick_device
    from harness import build_layout
    from meshlm.train.trainer import Trainer

    cfg = make_config(training__precision="fp16")
    layout = build_layout(cfg, 1)
    tr = Trainer(cfg, str(tmp_path), init_context(layout.shape(), pick_device("cpu")), layout)
    before = [p.detach().clone() for p in tr.par.optimizer.params]
    tr.state.scaler.scale = 2.0 ** 40  # fp16 overflows at 65504: the scaled gradients become inf
    out = tr.train_step()
    assert out["skipped"] and tr.state.scaler.scale == 2.0 ** 39
    assert all(torch.equal(a, p) for a, p in zip(before, tr.par.optimizer.params))
    tr.state.scaler.scale = 1024.0
    out = tr.train_step()
    assert not out["skipped"]
    assert not all(torch.equal(a, p) for a, p in zip(before, tr.par.optimizer.params))


def test_lr_schedule_warmup_and_cosine_floor():
    from meshlm.core.facts.course import lr_at
    o = C.OptimConfig(lr=1.0, warmup=4, min_lr_ratio=0.1)
    assert [lr_at(s, o, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(20, o, 20) == pytest.approx(0.1)
    assert lr_at(12, o, 20) == pytest.approx(0.55)


# --- our bucketed all-reduce against torch DDP ------------------------------------------------------

def ddp_case(bucket_mb: float) -> float:
    """Runs on every pool rank: same model, same per-rank micro-batches through torch DDP and ours."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from meshlm.distributed.comm import Comm
    from meshlm.model import PRESETS, Llama, materialize
    from meshlm.parallel.dims.data_parallel import GradBuckets
    from meshlm.parallel.dims.grad_sync import Reduction

    rank, world = dist.get_rank(), dist.get_world_size()

    def build():
        with torch.device("meta"):
            m = Llama(PRESETS["debug"])
        materialize(m, 0, "cpu")
        return m

    ref, ours = build(), build()
    ddp = DistributedDataParallel(ref, bucket_cap_mb=bucket_mb)
    params = list(ours.parameters())
    comm = Comm("dp", dist.group.WORLD, list(range(world)), rank)
    sync = GradBuckets(params, [Reduction(None, (comm,), (), world)] * len(params), int(bucket_mb * 2 ** 20))
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
               for _ in range(2)]
    loss = lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten()) / 2  # noqa: E731
    with ddp.no_sync():
        loss(ddp, *batches[0]).backward()
    loss(ddp, *batches[1]).backward()
    sync.begin_step()
    for i, (x, y) in enumerate(batches):
        sync.set_sync(i == 1)
        loss(ours, x, y).backward()
    sync.finish()
    calls = comm.stats["all_reduce"].calls
    assert calls == len(sync.buckets) >= (2 if bucket_mb < 1 else 1), calls  # only the last micro-batch talks
    return max((a.grad - b.grad).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))


@pytest.mark.parametrize("bucket_mb", [0.05, 25.0])
def test_bucketed_allreduce_matches_torch_ddp(pools, bucket_mb):
    diffs = pools(2).run(ddp_case, bucket_mb)
    assert max(diffs) < 1e-6, diffs


# --- no silent hang (docs/architecture.md, invariant 4) ------------------------------------------------------------

def hang_case() -> str:
    """Rank 1 stops answering at step 3; rank 0's all-reduce must fail naming rank 1 and the collective."""
    import torch.distributed as dist

    from meshlm.distributed.comm import CollectiveError, Comm
    from meshlm.distributed.watchdog import Watchdog

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=3))
    comm = Comm("dp", group, list(range(world)), rank)
    comm.watchdog = Watchdog.for_job(rank, world)
    comm.watchdog.beat(3 if rank == 0 else 2)
    if rank == 1:
        time.sleep(5)  # never joins the collective below
        return ""
    try:
        comm.all_reduce(torch.ones(4))
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_hung_rank_is_named(pools):
    msg = pools(2).run(hang_case)[0]
    assert "all_reduce on group 'dp'" in msg, msg
    assert "rank 1 at step 2" in msg and "stopped answering" in msg, msg
    assert msg.startswith("rank 0:")


# --- real launches ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRAIN_ARGS = ["--model.preset", "debug", "--data.seq_len", "32", "--training.global_batch", "8",
              "--training.micro_batch", "2", "--training.steps", "4", "--training.eval_every", "0",
              "--training.seed", "1", "--optim.warmup", "2", "--metrics.progress", "false"]


@pytest.mark.slow
def test_nproc_launch(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", "train", "--nproc", "2", "--run-dir", str(run_dir),
                           *TRAIN_ARGS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = read_metrics(str(run_dir))
    ref = run_local(C.load(str(run_dir / "config.toml")), str(tmp_path / "ref"))
    assert_same_losses(ref, got, 1e-5)
    # what --calibrate reads (docs/planner.md): the world, and on a CPU the threads, cores and schedstat seconds
    assert all(r["world"] == 2 and r["threads"] >= 1 and r["cores"] >= 1 and r["cpu_s"] > 0 and r["wait_s"] >= 0
               for r in got)


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes(tmp_path):
    """Two torchrun agents on loopback, --nnodes 2, one worker each, train together."""
    run_dir = tmp_path / "run"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                                "-m", "meshlm.cli", "train", "--run-dir", str(run_dir), *TRAIN_ARGS],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for node in (0, 1)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-1500:] for o in outs)
    got = read_metrics(str(run_dir))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    ref = run_local(C.load(str(run_dir / "config.toml")), str(tmp_path / "ref"))
    assert_same_losses(ref, got, 1e-5)


@pytest.mark.slow
def test_tensorboard_and_eval_are_written(tmp_path):
    recs = run_local(make_config(metrics__tensorboard=True, training__eval_every=5, training__steps=10), str(tmp_path))
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 200
    evals = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "eval_loss" in line]
    assert [e["step"] for e in evals] == [5, 10] and all(e["eval_loss"] > 0 for e in evals)
    assert recs[-1]["loss"] < recs[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "op"])  # op: per-op SAC traced by the compiler (issue 17)
def test_compiled_blocks_give_the_same_losses(tmp_path, ac):
    ref = run_local(make_config(training__steps=2), str(tmp_path / "eager"))
    got = run_local(make_config(training__steps=2, training__compile=True, training__ac=ac), str(tmp_path / "compiled"))
    assert_same_losses(ref, got, 1e-5)


def test_async_checkpoint_resumes_exactly(pools):
    from harness import train_case
    cfg = make_config(parallel__dp=2, checkpoint__every=4, checkpoint__keep=3, checkpoint__async=True, training__steps=10)
    run_dir = tempfile.mkdtemp(prefix="meshlm-async-")
    pools(2).run(train_case, C.to_dict(cfg), run_dir)
    ref = read_metrics(run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_00000004", "step_00000008"]
    truncate_run(run_dir, 4)
    resumed_cfg = make_config(parallel__dp=2, checkpoint__resume="auto", training__steps=10)
    pools(2).run(train_case, C.to_dict(resumed_cfg), run_dir)
    assert_same_losses(ref[4:], read_metrics(run_dir)[4:], 1e-5)
