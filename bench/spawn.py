"""Run one function on `world` local gloo workers and return what rank 0 puts on the queue (the
benchmarks' shared launcher)."""
from __future__ import annotations

import multiprocessing as mp
import socket


def spawn(worker, world: int, *args, timeout: float = 3600):
    """worker(rank, world, port, *args, out_queue): started on every rank; rank 0 puts the result."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port) + tuple(args) + (q,)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=timeout)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"worker exited with {p.exitcode}")
    return result
