"""The CPU calibration demo of issue 23: calibrate on a 2-rank run, predict a 4-rank run in another layout.

    python bench/calibrate.py [--rounds 3] [--steps 14] [--json] [--keep DIR]

Each round trains the calibration run (2 ranks, dp 2) and then the target run (4 ranks, tp 2 × dp 2)
with `meshlm train --nproc` (one thread per rank), back to back so that the machine's load hits both
alike, both with `metrics.profile_step` (rank 0's profiler trace of one step). It fits the machine on
the first (`plan/calibrate/fit.py`, per-category rates from its trace: nothing of the target run is used)
and prints the target's predicted step against its measured one; the summary is the median ratio. On
a 2-core machine the target's 4 ranks oversubscribe the cores. Beside the model's prediction the table
prints what other assumptions predict (docs/planner.md, "Calibration from a run"): `flat` (one fitted
compute rate, no trace: the model before the trace), `per-thread load` (other programs' load,
measured in the calibration run, competes with each of our threads) and `own core` (every rank a core
to itself); then the core share measured (schedstat: seconds on a core / seconds runnable) in both
runs, and the target's seconds per step by category, predicted against what its own trace measured
(the target's trace is only compared, never fitted).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
sys.path.insert(0, SRC)

from meshlm.plan.calibrate import fit as K  # noqa: E402
from meshlm.plan.cost.estimate import estimate, step_categories  # noqa: E402
from meshlm.plan.spec import shape_from_config, spec_from_config  # noqa: E402


def _median(run_dir: str, key: str) -> float:
    """A metrics key's median over the steps --calibrate reads (after warm-up, not the profiled one)."""
    prof = K.read_profile(run_dir)
    return statistics.median(r.get(key, float("nan")) for r in K._records(run_dir, prof["step"] if prof else 0))


def train(run_dir: str, nproc: int, common: list[str], extra: list[str]) -> float:
    """`meshlm train --nproc N` into run_dir; returns its wall seconds."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)  # the launcher's own rule: cores // ranks (K.threads_per_rank)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "meshlm.cli", "train", "--nproc", str(nproc), "--run-dir", run_dir,
                        *common, *extra], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"training {run_dir} failed:\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


PROBE_BYTES = [4096 * 4 ** k for k in range(6)]  # fp32 all-reduces of 4 KB .. 4 MB (a scalar is another regime)


def _probe_rank(rank: int, port: int, calls: int, q) -> None:
    import torch
    import torch.distributed as dist

    from meshlm.train.observe.metrics import sched_seconds
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for nbytes in PROBE_BYTES:
        x = torch.zeros(nbytes // 4)
        for _ in range(5):
            dist.all_reduce(x)
        dist.barrier()
        c0, t0 = sched_seconds()[0], time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        rows.append(((time.perf_counter() - t0) / calls, (sched_seconds()[0] - c0) / calls))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def probe(run_dir: str, calls: int = 40) -> dict:
    """The machine's collectives by size, like nccl-tests' all_reduce_perf: 2 ranks of one thread (as
    the calibration run), gloo, wall and core seconds per all-reduce; written to the run's
    link_probe.json, whose intercepts are the per-call cost `--calibrate` prices every call at
    (plan/calibrate.read_probe). Only the machine is measured, neither run."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_probe_rank, args=(r, port, calls, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=300)
    for p in procs:
        p.join()
    out = {"backend": "gloo", "ranks": 2, "threads": 1, "calls": calls, "bytes": PROBE_BYTES,
           "wall_s": [w for w, _ in rows], "core_s": [c for _, c in rows]}
    with open(os.path.join(run_dir, K.PROBE), "w") as f:
        json.dump(out, f)
    return out


def variants(calib: str, cfg, ranks: int, threads: int) -> tuple[dict, dict]:
    """Step seconds predicted under the model and under the assumptions it replaces, and the model's
    seconds per step by trace category."""
    shape, spec = shape_from_config(cfg), spec_from_config(cfg, ranks)
    cal = K.fit(calib)
    own = dataclasses.replace(cal, cores=0)  # each rank a whole core
    pred = {name: estimate(shape, spec, *K.device_and_options(c, ranks, False, threads))
            for name, c in (("model", cal), ("flat", K.fit(calib, trace=False)),
                            ("per_thread_load", K.fit(calib, load=None)), ("own_core", own))}
    return {k: v["step_s"] for k, v in pred.items()}, categories(pred["model"])


def core_seconds(calib: str, cfg, ranks: int, threads: int) -> dict:
    """Seconds on a core per step of one target rank, the quantity other programs' load does not
    change: the calibration fitted to the run's own seconds on a core (`on_core`: its `cpu_s` as if
    each rank had a core), priced at one whole core, with and without the trace, each collective call
    at the probe's core seconds (its wait for the peer is not time on a core). Compared with the
    target's `cpu_s`."""
    out = {}
    for name, trace in (("model", True), ("flat", False)):
        cal = K.fit(calib, trace=trace, on_core=True)
        cal = dataclasses.replace(cal, latency_s=cal.latency_core_s)
        out[name] = K.predict(cal, cfg, ranks, threads)["step_s"]
    return out


def categories(est: dict) -> dict:
    """The estimate's seconds per step in the trace's categories (calibrate_trace.split_profile)."""
    c = step_categories(est)
    return {"gemm": c["gemm"], "attention": c["attention"], "overhead": c["overhead"], "comm": c["comm"],
            "elementwise": sum(c[k] for k in ("elementwise", "launch", "loss", "grad_accum", "optimizer"))}


def traced(run_dir: str, step_s: float) -> dict:
    """A run's own trace in the same categories (dispatch and bytes together as element-wise)."""
    s = K.split_profile(K.read_profile(run_dir), step_s)
    return {"gemm": s["gemm"], "attention": s["attention"], "elementwise": s["dispatch"] + s["bytes"],
            "overhead": s["overhead"], "comm": s["comm"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--profile-step", type=int, default=4, help="the step both runs profile")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--keep", help="write the runs here (default: a temporary directory, removed)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    common = ["--model.preset", a.preset, "--data.seq_len", str(a.seq_len), "--training.global_batch",
              str(a.global_batch), "--training.micro_batch", str(a.micro_batch), "--training.steps", str(a.steps),
              "--training.eval_every", "0", "--training.peak_tflops", "1", "--metrics.progress", "false",
              "--checkpoint.resume", "never",
              "--metrics.profile_step", str(a.profile_step)]
    root = a.keep or tempfile.mkdtemp(prefix="meshlm-calib-")
    rows = []
    try:
        for i in range(a.rounds):
            calib, target = os.path.join(root, f"r{i}-dp2"), os.path.join(root, f"r{i}-tp2dp2")
            load = os.getloadavg()[0]
            train(calib, 2, common, [])
            probe(calib)
            train(target, 4, common, ["--parallel.tp", "2"])
            cal, got, base = K.fit(calib), K.measured(target), K.measured(calib)
            pred, cats = variants(calib, K.run_config(target), got.world, got.threads)
            meas = traced(target, got.step_s)
            cpu = core_seconds(calib, K.run_config(target), got.world, got.threads)
            rows.append({"round": i, "load": load, "uptime_after": os.getloadavg(), "calib_step_s": base.step_s,
                         "calib_comm_s": base.comm_s, "calib_available": base.available,
                         "target_available": got.available, "target_comm_s": got.comm_s,
                         "rates": {k: getattr(cal, k) for k in ("gemm_flops", "attn_flops", "ew_bytes_s",
                                                                "dispatch_s", "overhead_s", "link_bytes_s",
                                                                "latency_s", "latency_core_s")},
                         "calib_split": cal.split, "target_pred": cats, "target_traced": meas,
                         "measured_s": got.step_s, **{f"pred_{k}_s": v for k, v in pred.items()},
                         **{f"ratio_{k}": v / got.step_s for k, v in pred.items()},
                         "calib_cpu_s": _median(calib, "cpu_s"), "target_cpu_s": _median(target, "cpu_s"),
                         **{f"cpu_pred_{k}_s": v for k, v in cpu.items()}})
            r = rows[-1]
            r.update({f"cpu_ratio_{k}": r[f"cpu_pred_{k}_s"] / r["target_cpu_s"] for k in cpu})
            if not a.json:
                print(f"round {i}: loadavg {load:.1f}; dp2 {r['calib_step_s']:.3f} s/step (a core "
                      f"{r['calib_available']:.0%} of the time); tp2×dp2 predicted {r['pred_model_s']:.3f} s, "
                      f"measured {r['measured_s']:.3f} s (a core {r['target_available']:.0%}), ratio "
                      f"{r['ratio_model']:.3f} (flat {r['ratio_flat']:.3f}, per-thread load "
                      f"{r['ratio_per_thread_load']:.3f}, own core {r['ratio_own_core']:.3f}); cpu s/step/rank "
                      f"{r['calib_cpu_s']:.3f} -> {r['target_cpu_s']:.3f}", flush=True)
                print(f"    tp2×dp2 seconds on a core per step per rank: predicted {r['cpu_pred_model_s']:.3f} "
                      f"(flat {r['cpu_pred_flat_s']:.3f}), measured {r['target_cpu_s']:.3f}: ratio "
                      f"{r['cpu_ratio_model']:.3f} (flat {r['cpu_ratio_flat']:.3f})", flush=True)
                print(f"    link probe: {cal.latency_s * 1e3:.2f} ms per all-reduce call, "
                      f"{cal.latency_core_s * 1e3:.2f} ms of it on a core; link {cal.link_bytes_s / 1e9:.2f} "
                      f"GB/s per core", flush=True)
                print("    tp2×dp2 s/step predicted / traced: " + ", ".join(
                    f"{k} {cats[k]:.3f}/{meas[k]:.3f}" for k in cats), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    summary = {k: statistics.median(r[k] for r in rows)
               for k in ("ratio_model", "ratio_flat", "ratio_per_thread_load", "ratio_own_core", "cpu_ratio_model",
                         "cpu_ratio_flat")}
    if a.json:
        print(json.dumps({"rows": rows, "median": summary}, indent=1))
    else:
        print("median ratio predicted / measured: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
