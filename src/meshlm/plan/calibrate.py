"""`--calibrate RUN_DIR`: fit the machine's numbers from one finished run, then predict other layouts.

A run's metrics.jsonl gives the median step time after warm-up and the seconds each collective kind
took per step; its config.toml gives the layout. Two numbers are fitted, each from its own
measurement: the compute rate (the step minus its measured communication, against the planner's
compute time of that layout at a reference rate) and the link bandwidth (the measured collective
seconds against the planner's bytes of the same collectives). On a CPU the ranks share the cores, so
the rate is per core and a layout of more ranks than cores gets cores/ranks of it. What is fitted is
written back as a GPU profile (peak = the achieved rate, efficiency 1) and the Options that go with it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

from .. import config as C
from .estimate import Options, estimate
from .comm import LATENCY_S
from .hardware import GB, GPU, get_gpu
from .spec import PlanError, shape_from_config, spec_from_config

WARMUP_RECORDS = 2  # the first logged steps include compilation, allocator growth and pool start-up
REF_TFLOPS = 1.0    # the rate at which the link's bytes are read off the model (any works)


@dataclasses.dataclass(frozen=True)
class Calibration:
    rate_flops: float        # achieved FLOP/s of one rank with a core to itself (CPU) or one GPU
    link_bytes_s: float      # achieved bytes/s per rank of the run's collectives
    cores: int               # cores the run's ranks shared (0: one device per rank)
    source: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            recs = [json.loads(line) for line in f if '"step_s"' in line]
    except OSError as e:
        raise PlanError(f"--calibrate: cannot read {path}: {e.strerror}") from None
    if len(recs) <= WARMUP_RECORDS:
        raise PlanError(f"--calibrate: {path} has {len(recs)} logged steps; need more than {WARMUP_RECORDS} "
                        f"(the first are warm-up)")
    return recs[WARMUP_RECORDS:]


def measured(run_dir: str) -> tuple[float, float]:
    """(median step seconds, median communication seconds per step) after warm-up."""
    recs = _records(run_dir)
    step = statistics.median(r["step_s"] for r in recs)
    comm = statistics.median(sum(k["seconds"] for k in r.get("comm", {}).values()) for r in recs)
    return step, comm


def run_config(run_dir: str) -> C.Config:
    path = os.path.join(run_dir, "config.toml")
    if not os.path.exists(path):
        raise PlanError(f"--calibrate: {path} not found (a meshlm run directory has one)")
    return C.load(path)


def cpu_device(rate_flops: float, link_bytes_s: float, ranks: int, cores: int) -> GPU:
    """The CPU as the planner sees it for `ranks` ranks on `cores` cores: each rank gets
    min(1, cores/ranks) of a core's rate."""
    share = min(1.0, cores / ranks) if cores else 1.0
    ram = 64.0  # GB; the calibration predicts time, memory stays the planner's own model
    return get_gpu("custom", peak_tflops=rate_flops * share / 1e12, hbm_gb=ram,
                   nvlink_gbps=link_bytes_s / GB, ib_gbps=link_bytes_s / GB, gpus_per_node=1024)


def fit(run_dir: str, cores: int | None = None) -> Calibration:
    """The machine's compute rate and link bandwidth from one run (see the module docstring)."""
    cfg = run_config(run_dir)
    shape = shape_from_config(cfg)
    world = _world(run_dir, cfg)
    spec = spec_from_config(cfg, world)
    cores = os.cpu_count() or 1 if cores is None else cores
    step, comm = measured(run_dir)
    def predict(rate: float, link: float) -> dict:
        gpu = cpu_device(rate, link, world, cores)
        return estimate(shape, spec, gpu, Options(efficiency=1.0, block_overhead_s=0.0, comm_efficiency=1.0,
                                                  compiled=bool(cfg.training.compile)))

    # link: the measured collective seconds less their fixed per-call latency, over the wire bytes
    colls = predict(REF_TFLOPS * 1e12, GB)["comm"]
    wire = sum(c["bytes"] for c in colls)
    latency = sum(c["calls"] * LATENCY_S[c["link"]] for c in colls if c["bytes"] > 0)
    link = wire / max(comm - latency, 0.1 * comm) if wire > 0 and comm > 0 else GB
    # rate: the one whose predicted step (compute + exposed communication) is the measured step; the
    # step falls as the rate grows, so bisect on its logarithm
    lo, hi = 1e6, 1e16
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predict(mid, link)["step_s"] > step else (lo, mid)
    return Calibration(lo, link, cores, os.path.abspath(run_dir))


def _world(run_dir: str, cfg: C.Config) -> int:
    """The run's world size: the product of its resolved degrees (config.toml has dp resolved)."""
    p = cfg.parallel
    if p.dp < 1:
        raise PlanError(f"--calibrate: {run_dir}/config.toml has parallel.dp = {p.dp}; a run's resolved "
                        f"config has it set")
    return p.dp * p.tp * p.pp * p.cp


def device_and_options(cal: Calibration, ranks: int, compiled: bool = False) -> tuple[GPU, Options]:
    """The GPU profile and Options that price a layout of `ranks` ranks on the calibrated machine."""
    return cpu_device(cal.rate_flops, cal.link_bytes_s, ranks, cal.cores), \
        Options(efficiency=1.0, block_overhead_s=0.0, comm_efficiency=1.0, compiled=compiled)
