"""The benchmarks' shared launcher: run one function on `world` fresh local gloo workers."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int) -> None:
    """In a worker: one thread, join the gloo job on loopback."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def train_worker(rank: int, world: int, port: int, cfg_dict: dict, run_dir: str, q) -> None:
    """A worker that trains the config `cfg_dict` (config.to_dict) into `run_dir`: one rank of the job."""
    join_gloo(rank, world, port)
    from meshlm.core import config as C
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.train.trainer import Trainer

    from meshlm.distributed.mesh import device_defaults
    cfg = device_defaults(C.from_dict(cfg_dict))  # the entry's: "auto" keys for this device
    layout = build_layout(cfg, world)
    Trainer(cfg, run_dir, init_context(layout.shape(), pick_device("cpu")), layout).fit()
    q.put((rank, None))


# What a worker imports before its work: torch._dynamo comes with the first optimizer (torch.optim).
# DCP too: the trainer imports it on its first save or load only (train/checkpoint/pieces.py), and the
# pools' ranks save and resume often, each of which would otherwise import it (0.7 CPU-s) again
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "meshlm.train.trainer"]


def fork_context(preload: list[str] = PRELOAD):
    """Workers forked from one server process that imported `preload` once, instead of each spawned
    worker importing them itself (seconds of CPU per worker; tests/harness.py's pools use it too). The
    server starts with one OpenMP thread, so no thread pool exists to be copied into a fork."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
    return ctx


def _call_and_exit(worker, *args) -> None:
    """Run `worker`, flush its result queue, then leave without interpreter teardown: a gloo worker
    thread still joinable when C++ static destructors run aborts the process ("terminate called
    without an active exception") after the results are already out, which made a finished bench
    exit non-zero. Exceptions still exit 1 with their traceback."""
    q = args[-1]
    try:
        worker(*args)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    else:
        code = 0
    q.close()
    q.join_thread()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _run(worker, world: int, args: tuple, timeout: float, results: int) -> list:
    ctx = fork_context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_call_and_exit, args=(worker, r, world, port) + tuple(args) + (q,))
             for r in range(world)]
    for p in procs:
        p.start()
    out = [q.get(timeout=timeout) for _ in range(results)]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"worker exited with {p.exitcode}")
    return out


def spawn(worker, world: int, *args, timeout: float = 3600):
    """worker(rank, world, port, *args, out_queue) on every rank; rank 0 puts the one result."""
    return _run(worker, world, args, timeout, 1)[0]


def spawn_gloo(worker, world: int, *args, timeout: float = 1800) -> dict:
    """Like `spawn`, but every rank puts (rank, result): returns {rank: result}."""
    return dict(_run(worker, world, args, timeout, world))
