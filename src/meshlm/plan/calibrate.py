"""`--calibrate RUN_DIR`: fit the machine's numbers from one finished run, then predict other layouts.

A run's metrics.jsonl gives the median step time after warm-up, the seconds each collective kind
took per step, and the world size, threads per rank and cores the run had; its config.toml gives the
layout. Two numbers are fitted, each from its own measurement: the link bandwidth (the measured
collective seconds against the planner's bytes of the same collectives) and the compute rate (the one
at which the planner's step of that layout is the measured step). Nothing is fitted to the layout
being predicted.

On a CPU the ranks share the cores (docs/planner.md, "Calibration from a run"): a rank keeps
min(threads, cores / ranks) cores busy, and both its math and its gloo transfers (memory copies done
by the same cores) run at that share. So the fitted numbers are per core, and a layout of more ranks
than cores gets cores/ranks of them each. Time a rank spends blocked waiting for a peer is not
priced: on an oversubscribed machine the other ranks on that core fill it. Other programs' load is in
the fitted rate (the run's cores were that much slower); pricing it per thread instead (`load`) was
measured and refused (docs/planner.md). What is fitted is written
back as a GPU profile (peak = the achieved rate, efficiency 1) and the Options that go with it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

from .. import config as C
from .comm import LATENCY_S
from .estimate import Options, estimate
from .hardware import GB, GPU, get_gpu
from .spec import PlanError, shape_from_config, spec_from_config

WARMUP_RECORDS = 2  # the first logged steps include compilation, allocator growth and pool start-up
REF_TFLOPS = 1.0    # the rate at which the link's bytes are read off the model (any works)


@dataclasses.dataclass(frozen=True)
class Calibration:
    rate_flops: float        # achieved FLOP/s per core a rank keeps busy (CPU), or of one GPU (cores 0)
    link_bytes_s: float      # achieved collective bytes/s per rank, per core it keeps busy (CPU)
    cores: int               # cores the run's ranks shared (0: one device per rank)
    source: str = ""
    load: float = 0.0        # other programs' runnable threads on those cores during the run (CPU)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What one run measured, medians over its logged steps after warm-up."""
    step_s: float
    comm_s: float            # seconds per step blocked in collectives (rank 0, every kind)
    world: int | None        # ranks; None for runs logged before metrics carried it
    threads: int | None      # torch threads per rank
    cores: int | None        # cores the process could run on
    available: float | None  # rank 0's seconds on a core / seconds runnable (CPU runs that logged it)


def _records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            recs = [json.loads(line) for line in f if '"step_s"' in line]
    except OSError as e:
        raise PlanError(f"--calibrate: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"--calibrate: {path} is not JSON Lines ({e.msg})") from None
    if len(recs) <= WARMUP_RECORDS:
        raise PlanError(f"--calibrate: {path} has {len(recs)} logged steps; need more than {WARMUP_RECORDS} "
                        f"(the first are warm-up)")
    return recs[WARMUP_RECORDS:]


def measured(run_dir: str) -> Measured:
    """The run's median step and communication seconds after warm-up, and the machine it ran on."""
    recs = _records(run_dir)
    step = statistics.median(r["step_s"] for r in recs)
    comm = statistics.median(sum(k["seconds"] for k in r.get("comm", {}).values()) for r in recs)
    last = recs[-1]
    timed = [r for r in recs if r.get("cpu_s") is not None and r.get("wait_s") is not None]
    avail = statistics.median(r["cpu_s"] / max(r["cpu_s"] + r["wait_s"], 1e-12) for r in timed) if timed else None
    return Measured(step, comm, last.get("world"), last.get("threads"), last.get("cores"), avail)


def run_config(run_dir: str) -> C.Config:
    path = os.path.join(run_dir, "config.toml")
    if not os.path.exists(path):
        raise PlanError(f"--calibrate: {path} not found (a meshlm run directory has one)")
    return C.load(path)


def threads_per_rank(ranks: int, cores: int) -> int:
    """Torch threads per rank when `meshlm train --nproc` starts `ranks` workers on `cores` cores
    without OMP_NUM_THREADS set (train/launch.py: cores // ranks, at least one)."""
    return max(1, cores // ranks)


def core_share(ranks: int, cores: int, threads: int | None = None, load: float = 0.0) -> float:
    """Cores one rank keeps busy. Linux gives every runnable thread the same share of the cores, so
    with `ranks` × `threads` of ours and `load` other runnable threads each of ours gets
    min(1, cores / (ranks·threads + load)) of a core. cores = 0: one device per rank (a GPU), share 1."""
    if not cores:
        return 1.0
    threads = threads_per_rank(ranks, cores) if threads is None else threads
    return threads * min(1.0, cores / (ranks * threads + load))


def external_load(available: float | None, ranks: int, cores: int, threads: int) -> float:
    """Other programs' runnable threads implied by the share of a core our threads got while
    runnable (`available`, from the run's schedstat seconds): the inverse of core_share."""
    if not available or not cores:
        return 0.0
    return max(0.0, cores / min(available, 1.0) - ranks * threads)


def cpu_device(rate_flops: float, link_bytes_s: float, ranks: int, cores: int, threads: int | None = None,
               load: float = 0.0) -> GPU:
    """The CPU as the planner sees it for `ranks` ranks of `threads` threads on `cores` cores beside
    `load` other runnable threads: the per-core rate and link bandwidth times the cores each rank
    keeps busy (core_share)."""
    share = core_share(ranks, cores, threads, load)
    ram = 64.0  # GB; the calibration predicts time, memory stays the planner's own model
    return get_gpu("custom", peak_tflops=rate_flops * share / 1e12, hbm_gb=ram,
                   nvlink_gbps=link_bytes_s * share / GB, ib_gbps=link_bytes_s * share / GB, gpus_per_node=1024)


OPTIONS = dict(efficiency=1.0, block_overhead_s=0.0, comm_efficiency=1.0)  # the flat model at the fitted rate


def fit(run_dir: str, cores: int | None = None, load: float | None = 0.0) -> Calibration:
    """The machine's compute rate and link bandwidth from one run (see the module docstring).
    `cores`: the cores the run's ranks shared (default: what its metrics say; 0 for a GPU run);
    `load`: other programs' runnable threads competing per thread (default 0: the cores the run got
    are shared among its own ranks only; None: implied by the run's schedstat seconds)."""
    cfg = run_config(run_dir)
    m = measured(run_dir)
    world = _world(run_dir, cfg, m)
    if cores is None:  # a run that logs its world but no cores ran one rank per GPU
        cores = m.cores if m.cores or m.world else os.cpu_count() or 1
    threads = m.threads or threads_per_rank(world, cores or 1)
    load = external_load(m.available, world, cores, threads) if load is None else load
    share = core_share(world, cores, threads, load)
    shape, spec = shape_from_config(cfg), spec_from_config(cfg, world)
    opts = Options(**OPTIONS, compiled=bool(cfg.training.compile))

    def predict(rate: float, link: float) -> dict:
        return estimate(shape, spec, cpu_device(rate, link, world, cores, threads, load), opts)

    # link: the measured collective seconds less their fixed per-call latency, over the wire bytes
    colls = predict(REF_TFLOPS * 1e12, GB)["comm"]
    wire = sum(c["bytes"] for c in colls)
    latency = sum(c["calls"] * LATENCY_S[c["link"]] for c in colls if c["bytes"] > 0)
    comm = m.comm_s
    link = wire / max(comm - latency, 0.1 * comm) / share if wire > 0 and comm > 0 else GB
    # rate: the one whose predicted step (compute + exposed communication) is the measured step; the
    # step falls as the rate grows, so bisect on its logarithm
    lo, hi = 1e6, 1e16
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predict(mid, link)["step_s"] > m.step_s else (lo, mid)
    return Calibration(lo, link, cores, os.path.abspath(run_dir), load)


def _world(run_dir: str, cfg: C.Config, m: Measured) -> int:
    """The run's world size: what its metrics recorded, else the product of its resolved degrees."""
    if m.world:
        return int(m.world)
    p = cfg.parallel
    if p.dp < 1:
        raise PlanError(f"--calibrate: {run_dir}/metrics.jsonl does not record the world size and its "
                        f"config.toml has parallel.dp = {p.dp}; set parallel.dp to the run's")
    return p.dp * p.tp * p.pp * p.cp


def device_and_options(cal: Calibration, ranks: int, compiled: bool = False,
                       threads: int | None = None) -> tuple[GPU, Options]:
    """The GPU profile and Options that price a layout of `ranks` ranks on the calibrated machine
    (`threads` per rank: default what `meshlm train --nproc` gives them)."""
    return cpu_device(cal.rate_flops, cal.link_bytes_s, ranks, cal.cores, threads, cal.load), \
        Options(**OPTIONS, compiled=compiled)


def predict(cal: Calibration, cfg: C.Config, ranks: int, threads: int | None = None) -> dict:
    """The planner's estimate of `cfg` on `ranks` ranks of the calibrated machine."""
    gpu, o = device_and_options(cal, ranks, bool(cfg.training.compile), threads)
    return estimate(shape_from_config(cfg), spec_from_config(cfg, ranks), gpu, o)
