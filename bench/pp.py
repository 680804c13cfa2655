"""Pipeline schedules on real ranks: measured step time vs what the schedule simulator predicts.

    .venv/bin/python bench/pp.py [--pp 4] [--microbatches 8] [--steps 3] [--rounds 3] [--schedules gpipe 1f1b ...]

For each schedule this trains a few steps of an 8-block model on `pp` gloo workers (one thread each),
times every step on rank 0, and gathers every step's measured timeline (core/schedule/trace.py).
Schedules alternate over several rounds on the same workers; the table reports medians over all.
It prints a markdown table (docs/benchmarks.md): median step time and its ratio to gpipe, next to
the simulator's ratio twice: with the textbook costs (F=1, B=2, W=B/2) and with the per-action
durations measured in this very run (which prices the zero-bubble W recompute, see runtime.py).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

MODEL = {"model.preset": "small", "model.n_layers": 8, "data.seq_len": 128, "training.micro_batch": 2,
         "training.eval_every": 0, "metrics.progress": False, "checkpoint.resume": "never", "training.seed": 0}


def _worker(rank: int, world: int, port: int, tasks, out) -> None:
    """A persistent rank: builds a Trainer per task (schedule), so schedules alternate in rounds and
    a change of machine load hits them all alike."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from meshlm.core import config as C
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.core.schedule.trace import gather_spans, measured_bubble
    from meshlm.core.schedule.replay import p2p_batches
    from meshlm.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while (task := tasks.get()) is not None:
        overrides, steps = task
        cfg = C.Config()
        for k, v in overrides.items():
            C.apply(cfg, k, v)
        layout = build_layout(cfg, world)
        ctx = init_context(layout.shape(), pick_device("cpu"), timeout_s=600)
        trainer = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-bench-pp-"), ctx, layout)
        rt = trainer.par.pipeline
        counts = [len(p2p_batches(a)) for a in rt.actions]
        trainer.train_step()  # warm-up, not counted
        times, bubbles, durs = [], [], {}
        for _ in range(steps):
            ctx.comm("world").barrier()
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
            spans = gather_spans(rt.comm, rt.last_times, counts)
            bubbles.append(measured_bubble(rt.actions, spans))
            for r, acts in enumerate(rt.actions):
                for it, (s, e) in zip(p2p_batches(acts), spans[r]):
                    if not isinstance(it, tuple):
                        durs.setdefault(it.kind, []).append(e - s)
        if rank == 0:
            out.put((times, bubbles, durs))
    dist.destroy_process_group()


class Workers:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.out = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.out))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def measure(self, overrides: dict, steps: int):
        for q in self.tasks:
            q.put((overrides, steps))
        return self.out.get(timeout=1800)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join()


def simulated(name: str, p: int, m: int, v: int, costs: dict | None = None):
    from meshlm.core.schedule import build_schedule, simulate

    c = costs or {"cost_f": 1.0, "cost_b": 2.0}
    return simulate(build_schedule(name, p, m, v), p, m, v, **c)


def measured_costs(durs: dict, v: int) -> dict:
    """Per-rank costs (simulate's unit: a whole rank's share) from mean per-chunk durations."""
    f = durs["F"] * v
    if "W" in durs:
        return {"cost_f": f, "cost_b": (durs["I"] + durs["W"]) * v, "cost_w": durs["W"] * v}
    return {"cost_f": f, "cost_b": durs["B"] * v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per schedule and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all schedules (medians over all)")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb-h1"])
    args = ap.parse_args(argv)
    p, m = args.pp, args.microbatches
    acc = {name: ([], [], {}) for name in args.schedules}
    workers = Workers(p)
    try:
        for rnd in range(args.rounds):
            for name in args.schedules:
                v = 2 if name == "interleaved" else 1
                ov = dict(MODEL, **{"parallel.pp": p, "parallel.pp_schedule": name, "parallel.pp_virtual": v,
                                    "training.global_batch": m * MODEL["training.micro_batch"],
                                    "training.steps": args.steps + 1})
                times, bubbles, durs = workers.measure(ov, args.steps)
                acc[name][0].extend(times)
                acc[name][1].extend(bubbles)
                for k, xs in durs.items():
                    acc[name][2].setdefault(k, []).extend(xs)
                print(f"# round {rnd} {name}: step {statistics.median(times):.3f}s "
                      f"bubble {statistics.median(bubbles):.1%}", file=sys.stderr, flush=True)
    finally:
        workers.close()
    rows = {}
    for name, (times, bubbles, durs) in acc.items():
        v = 2 if name == "interleaved" else 1
        mean = {k: statistics.mean(x) for k, x in durs.items()}
        rows[name] = (v, statistics.median(times), statistics.median(bubbles), mean)
        print(f"# {name}: mean action ms {({k: round(x * 1e3, 1) for k, x in mean.items()})}", file=sys.stderr)
    base = rows.get("gpipe")
    base_sim = simulated("gpipe", p, m, 1)
    base_cal = simulated("gpipe", p, m, 1, measured_costs(base[3], 1)) if base else None
    print(f"pp={p}, m={m}, {os.cpu_count()} CPU cores, gloo, 1 thread per rank, "
          f"model small×{MODEL['model.n_layers']} blocks, seq {MODEL['data.seq_len']}, micro-batch "
          f"{MODEL['training.micro_batch']}\n")
    print("| schedule | step s | ratio to gpipe | sim ratio (F=1,B=2) | sim ratio (measured costs) "
          "| bubble measured | bubble sim (F=1,B=2) |")
    print("|---|---|---|---|---|---|---|")
    for name, (v, step, bubble, durs) in rows.items():
        sim = simulated(name, p, m, v)
        cal = simulated(name, p, m, v, measured_costs(durs, v))
        ratio = f"{step / base[1]:.2f}" if base else "-"
        cal_ratio = f"{cal.makespan / base_cal.makespan:.2f}" if base_cal else "-"
        print(f"| {name}{' v=2' if v > 1 else ''} | {step:.3f} | {ratio} | {sim.makespan / base_sim.makespan:.2f} "
              f"| {cal_ratio} | {bubble:.1%} | {sim.bubble:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
