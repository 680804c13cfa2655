"""`--calibrate RUN_DIR`: fit the machine's numbers from one finished run, then predict other layouts.

A run's metrics.jsonl gives the median step time after warm-up, the seconds each collective kind
took per step, and the world size, threads per rank and cores the run had; its config.toml gives the
layout. Two numbers are fitted, each from its own measurement: the link bandwidth (the measured
collective seconds against the planner's bytes of the same collectives) and the compute rate (the one
at which the planner's step of that layout is the measured step). Nothing is fitted to the layout
being predicted.

On a CPU the ranks share the cores (calibrate/cores.py; docs/planner.md, "Calibration from a run"): a
rank keeps min(threads, cores / ranks) cores busy, and both its math and its gloo transfers (memory
copies done by the same cores) run at that share. So the fitted numbers are per core, and a layout of more ranks
than cores gets cores/ranks of them each. Time a rank spends blocked waiting for a peer is not
priced: on an oversubscribed machine the other ranks on that core fill it. Other programs' load is in
the fitted rate (the run's cores were that much slower); pricing it per thread instead (`load`) was
measured and refused (docs/planner.md). What is fitted is written
back as a GPU profile (peak = the achieved rate, efficiency 1) and the Options that go with it.

With a profiler trace of one step (RUN_DIR/profile.json, `metrics.profile_step`; read by
calibrate/trace.py) the compute is fitted per category instead of at one rate: the trace splits the measured step into GEMM, attention-kernel,
element-wise (bytes) and per-op dispatch seconds, plus the time outside every op (Python, the
autograd engine); each category's rate is the planner's work of that category for the run's layout
(plan/cost/ops.py: GEMM FLOPs, attention FLOPs, element-wise bytes, kernels) over its seconds. A layout
then costs its own work at those rates (ops.Rates): GEMMs shrink with tp, norms, dispatch and the
per-step overhead do not (docs/planner.md, "Calibration from a run").

A run on a GPU (its profile.json says "cuda") is fitted by calibrate/gpu.py instead: the card's own
profile with its GEMM ceiling, attention factor and HBM efficiency fitted to the kernels of the trace.

A link probe beside the run (RUN_DIR/link_probe.json: all-reduces of several sizes, bench/calibrate.py)
gives the fixed cost of a collective call, which the run's own collectives (one bucket and a few scalars
per step) cannot separate from the bandwidth; without one the GPU profile's per-call latency stays.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

from ...core import config as C
from .cores import core_share, cpu_device, external_load, threads_per_rank
from .trace import read_json, read_profile, split_profile
from ..cost.comm import LATENCY_S, latency as call_latency
from ..cost.estimate import Options, estimate
from ..hardware import GB, GPU, profile_of_device
from ..cost.ops import Rates, unit_rates
from ..cost.scale import depth
from ..spec import PlanError, Spec, code_options, priced_on, shape_from_config, spec_from_config

WARMUP_RECORDS = 2  # the first logged steps include compilation, allocator growth and pool start-up
REF_TFLOPS = 1.0    # the rate at which the link's bytes are read off the model (any works)


@dataclasses.dataclass(frozen=True)
class Calibration:
    rate_flops: float        # achieved FLOP/s per core a rank keeps busy (CPU), or of one GPU (cores 0)
    link_bytes_s: float      # achieved collective bytes/s per rank, per core it keeps busy (CPU)
    cores: int               # cores the run's ranks shared (0: one device per rank)
    source: str = ""
    load: float = 0.0        # other programs' runnable threads on those cores during the run (CPU)
    # from a profiler trace (None without one), per core a rank keeps busy like the two above:
    gemm_flops: float | None = None   # GEMM FLOP/s
    attn_flops: float | None = None   # attention-core FLOP/s (plan/cost/ops.py counting)
    ew_bytes_s: float | None = None   # element-wise bytes/s of the planner's tables
    dispatch_s: float | None = None   # core-seconds per element-wise kernel of the planner's tables
    overhead_s: float | None = None   # core-seconds per step outside every op
    split: dict | None = dataclasses.field(default=None, compare=False, hash=False)  # the trace's seconds per step
    # from a link probe beside the run (None without one: the profile's per-call latency, comm.LATENCY_S)
    latency_s: float | None = None       # seconds per collective call, wall, one rank per core
    latency_core_s: float | None = None  # of which on a core (the rest waits for the peer)
    # a GPU run (calibrate/gpu.py): the card with its fitted efficiencies; overhead_s and split as above
    card: GPU | None = None

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
    cpu_s: float | None = None  # rank 0's seconds on a core per step, all its threads (CPU runs)
    peak_label: str | None = None   # the device the run's MFU was read against (metrics `peak_label`)
    peak_flops: float | None = None


def _records(run_dir: str, skip: int = 0) -> list[dict]:
    """The logged steps after warm-up, less step `skip` (the profiled one: the profiler slows it)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            recs = [r for r in (json.loads(x) for x in f if x.strip()) if "step_s" in r and r.get("step") != skip]
    except OSError as e:
        raise PlanError(f"--calibrate: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"--calibrate: {path} is not JSON Lines ({e.msg})") from None
    full = max((r.get("global_batch", 0) for r in recs), default=0)  # training.batch_rampup: the model
    recs = [r for r in recs if r.get("global_batch", full) == full]  # is priced at the full batch
    if len(recs) <= WARMUP_RECORDS:
        raise PlanError(f"--calibrate: {path} has {len(recs)} logged steps{' at the full batch' if full else ''}; "
                        f"need more than {WARMUP_RECORDS} (the first are warm-up)")
    return recs[WARMUP_RECORDS:]


def measured(run_dir: str) -> Measured:
    """The run's median step and communication seconds after warm-up, and the machine it ran on."""
    prof = read_profile(run_dir)
    recs = _records(run_dir, prof["step"] if prof else 0)
    step = statistics.median(r["step_s"] for r in recs)
    comm = statistics.median(sum(k["seconds"] for k in r.get("comm", {}).values()) for r in recs)
    last = recs[-1]
    timed = [r for r in recs if r.get("cpu_s") is not None and r.get("wait_s") is not None]
    avail = statistics.median(r["cpu_s"] / max(r["cpu_s"] + r["wait_s"], 1e-12) for r in timed) if timed else None
    cpu = statistics.median(r["cpu_s"] for r in timed) if timed else None
    return Measured(step, comm, last.get("world"), last.get("threads"), last.get("cores"), avail, cpu,
                    last.get("peak_label"), last.get("peak_flops"))


# ------------------------------------------------------------------ the link probe (per-call cost)

PROBE = "link_probe.json"  # bench/calibrate.py writes it into the calibration run's directory


def read_probe(run_dir: str) -> tuple[float, float] | None:
    """(wall, core) seconds per collective call on the run's machine, or None without a probe. The
    probe ({"bytes": [...], "wall_s": [...], "core_s": [...]}, one all-reduce per entry, each a mean
    over many calls) measures what the run's own metrics cannot: its collectives are one bucket and
    a few scalars per step, so their fixed cost per call and their bandwidth are not separable. Each
    is the intercept of a least-squares line through the probe's sizes."""
    def parse(p: dict) -> tuple[float, float]:
        x, wall, core = ([float(v) for v in p[k]] for k in ("bytes", "wall_s", "core_s"))
        if not len(x) == len(wall) == len(core) or len(set(x)) < 2:
            raise ValueError("needs two sizes or more, one wall and one core time each")
        return _intercept(x, wall), _intercept(x, core)
    return read_json(run_dir, PROBE, "a link probe", parse)


def _intercept(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    return max(0.0, my - slope * mx)


def run_config(run_dir: str) -> C.Config:
    path = os.path.join(run_dir, "config.toml")
    if not os.path.exists(path):
        raise PlanError(f"--calibrate: {path} not found (a meshlm run directory has one)")
    return C.load(path)


OPTIONS = dict(efficiency=1.0, block_overhead_s=0.0, comm_efficiency=1.0)  # the flat model at the fitted rate


def fit(run_dir: str, cores: int | None = None, load: float | None = 0.0, trace: bool = True,
        on_core: bool = False) -> Calibration:
    """The machine's compute rate and link bandwidth from one run (see the module docstring).
    `cores`: the cores the run's ranks shared (default: what its metrics say; 0 for a GPU run);
    `load`: other programs' runnable threads competing per thread (default 0: the cores the run got
    are shared among its own ranks only; None: implied by the run's schedstat seconds); `trace`: read
    the run's profile.json when it has one (False: the one flat rate); `on_core`: fit to the run's
    seconds on a core per step (median `cpu_s`) as if each rank had a core to itself, i.e. the rates of
    the core time the run actually got whatever other programs took (bench/calibrate.py's check)."""
    cfg = run_config(run_dir)
    m = measured(run_dir)
    prof = read_profile(run_dir) if trace else None
    if prof is not None and prof.get("device") == "cuda":
        return _fit_gpu(run_dir, cfg, m, prof)
    if (prof is None or not trace) and not m.cores and profile_of_device(m.peak_label or "") is not None:
        return _fit_gpu(run_dir, cfg, m, None)  # a GPU run without a trace: the card, one factor
    cfg = priced_on(cfg, gpu=False)  # a run writes resolved values into config.toml; an "auto" left: a CPU run
    if on_core:
        if m.cpu_s is None:
            raise PlanError(f"--calibrate: {run_dir}/metrics.jsonl has no cpu_s (seconds on a core per step)")
        m, cores, load = dataclasses.replace(m, step_s=m.cpu_s), 0, 0.0
    spec = _spec(run_dir, cfg, m)
    world = spec.world_size
    if cores is None:  # a run that logs its world but no cores ran one rank per GPU
        cores = m.cores if m.cores or m.world else os.cpu_count() or 1
    threads = m.threads or threads_per_rank(world, cores or 1)
    load = external_load(m.available, world, cores, threads) if load is None else load
    share = core_share(world, cores, threads, load)
    shape = shape_from_config(cfg)
    opts = Options(**OPTIONS, compiled=bool(cfg.training.compile))
    probe = read_probe(run_dir)

    def predict(rate: float, link: float) -> dict:
        return estimate(shape, spec, cpu_device(rate, link, world, cores, threads, load, probe), opts)

    # link: the measured collective seconds less their per-call latency (at the group's depth), over the wire bytes
    colls = predict(REF_TFLOPS * 1e12, GB)["comm"]
    wire = sum(c["bytes"] for c in colls)
    ref = cpu_device(REF_TFLOPS * 1e12, GB, world, cores, threads, load, probe)
    latency = sum(c["calls"] * call_latency(ref, c["link"]) * depth(c["kind"], c["group_size"])
                  for c in colls if c["bytes"] > 0)
    comm = m.comm_s
    link = wire / max(comm - latency, 0.1 * comm) / share if wire > 0 and comm > 0 else GB
    # rate: the one whose predicted step (compute + exposed communication) is the measured step; the
    # step falls as the rate grows, so bisect on its logarithm
    lo, hi = 1e6, 1e16
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predict(mid, link)["step_s"] > m.step_s else (lo, mid)
    cal = Calibration(lo, link, cores, os.path.abspath(run_dir), load,
                      latency_s=probe[0] if probe else None, latency_core_s=probe[1] if probe else None)
    if prof is None:
        return cal
    # per category: the planner's work of the run's own layout over the seconds the trace gave it
    split = split_profile(prof, m.step_s)
    gpu = cpu_device(lo, link, world, cores, threads, load)

    def work(category: str) -> float:
        t = estimate(shape, spec, gpu, _rated(unit_rates(category), opts.compiled))["time"]
        return t["forward_s"] + t["backward_s"] + t["recompute_s"] + t["optimizer_s"]

    w = {k: work(k) for k in ("gemm", "attention", "bytes", "dispatch")}
    rate = lambda k, fallback: w[k] / split[k] / share if split[k] > 0 and w[k] > 0 else fallback  # noqa: E731
    gemm = rate("gemm", lo)
    return dataclasses.replace(
        cal, gemm_flops=gemm, attn_flops=rate("attention", gemm), ew_bytes_s=rate("bytes", 1e300),
        dispatch_s=split["dispatch"] * share / w["dispatch"] if w["dispatch"] > 0 else 0.0,
        overhead_s=split["overhead"] * share, split=split)


def _fit_gpu(run_dir: str, cfg: C.Config, m: Measured, prof: dict | None) -> Calibration:
    """One rank per GPU: the card's efficiencies from the kernels of the profiled step (calibrate_gpu)."""
    from .gpu import fit_card
    cfg = priced_on(cfg, gpu=True)
    gpu, overhead, split = fit_card(shape_from_config(cfg), _spec(run_dir, cfg, m), bool(cfg.training.compile),
                                    m.step_s, prof, m.peak_label, m.peak_flops)
    link = gpu.nvlink_bw  # the card's; a one-GPU run measures no link
    return Calibration(gpu.peak_flops, link, 0, os.path.abspath(run_dir), overhead_s=overhead, split=split,
                       card=gpu)


def _rated(rates: Rates, compiled: bool) -> Options:
    """The per-operation model at a calibrated machine's rates."""
    return Options(efficiency=None, block_overhead_s=0.0, comm_efficiency=1.0, compiled=compiled, rates=rates)


def _spec(run_dir: str, cfg: C.Config, m: Measured) -> Spec:
    """The run's layout: on the world size its metrics recorded, else on the ranks its degrees fix."""
    if not m.world and cfg.parallel.dp < 1:
        raise PlanError(f"--calibrate: {run_dir}/metrics.jsonl does not record the world size and its "
                        f"config.toml has parallel.dp = {cfg.parallel.dp}; set parallel.dp to the run's")
    return spec_from_config(cfg, int(m.world) if m.world else None)


def device_and_options(cal: Calibration, ranks: int, compiled: bool = False,
                       threads: int | None = None) -> tuple[GPU, Options]:
    """The GPU profile and Options that price a layout of `ranks` ranks on the calibrated machine
    (`threads` per rank: default what `meshlm train --nproc` gives them)."""
    if cal.card is not None:
        return cal.card, Options(compiled=compiled, step_overhead_s=cal.overhead_s)
    probe = None if cal.latency_s is None else (cal.latency_s, cal.latency_core_s or 0.0)
    gpu = cpu_device(cal.rate_flops, cal.link_bytes_s, ranks, cal.cores, threads, cal.load, probe)
    if cal.gemm_flops is None:
        return gpu, Options(**OPTIONS, compiled=compiled)
    share = core_share(ranks, cal.cores, threads, cal.load)
    return gpu, _rated(Rates(cal.gemm_flops * share, cal.attn_flops * share, cal.ew_bytes_s * share,
                             cal.dispatch_s / share, cal.overhead_s / share), compiled)


def predict(cal: Calibration, cfg: C.Config, ranks: int, threads: int | None = None) -> dict:
    """The planner's estimate of `cfg` on `ranks` ranks of the calibrated machine."""
    cfg = priced_on(cfg, gpu=cal.card is not None)
    gpu, o = device_and_options(cal, ranks, bool(cfg.training.compile), threads)
    o = dataclasses.replace(o, **code_options(cfg))
    return estimate(shape_from_config(cfg), spec_from_config(cfg, ranks), gpu, o)


def rate_sources(cal: Calibration, ranks: int, threads: int | None = None) -> tuple[str, dict]:
    """What `meshlm estimate --calibrate` says of its numbers: a line naming the run and the cores each
    of this layout's ranks keeps busy, and per step category (estimate.step_categories) the rate fitted
    from the run that priced it. Categories left out (the bubble) are the model's own."""
    if cal.card is not None:
        return _gpu_sources(cal)
    share = core_share(ranks, cal.cores, threads, cal.load)
    where = (f"{cal.cores} cores shared by {ranks} ranks: {share:.2f} of a core each" if cal.cores
             else "one device per rank")
    load = f", beside {cal.load:.1f} other runnable threads" if cal.load else ""
    fitted = "per category from its profiler trace" if cal.gemm_flops is not None else \
        "one flat compute rate (the run has no profile.json)"
    unit = " per core" if cal.cores else ""
    line = f"calibrated from {cal.source}: {where}{load}; rates fitted {fitted}"
    notes = {"comm": f"link {cal.link_bytes_s / GB:.3g} GB/s{unit}, fitted from its collectives"
             + (f"; {cal.latency_s * 1e3:.3g} ms per call ({(cal.latency_core_s or 0) * 1e3:.3g} ms on a core) "
                f"from its link probe" if cal.latency_s is not None else
                f"; {LATENCY_S['nvlink'] * 1e6:.3g} µs per call, the model's (no link probe)")}
    if cal.gemm_flops is None:
        notes.update(compute=f"{cal.rate_flops / 1e9:.3g} GFLOP/s{unit}, fitted to its step",
                     optimizer="at the same flat rate's memory traffic")
        return line, notes
    bw = f"{cal.ew_bytes_s / 1e9:.3g} GB/s{unit}"
    notes.update(gemm=f"{cal.gemm_flops / 1e9:.3g} GFLOP/s{unit}, fitted", attention=f"{cal.attn_flops / 1e9:.3g} "
                 f"GFLOP/s{unit}, fitted", elementwise=f"{bw}, fitted", launch=f"{cal.dispatch_s * 1e6:.3g} µs per "
                 f"kernel{unit}, fitted", loss=f"at the fitted {bw}", grad_accum=f"at the fitted {bw}",
                 optimizer=f"at the fitted {bw}", recompute="at the fitted rates",
                 overhead=f"{cal.overhead_s:.3g} s per step{unit}, fitted")
    return line, notes


def _gpu_sources(cal: Calibration) -> tuple[str, dict]:
    """rate_sources for a GPU run: the card, and each category's fitted efficiency and kernel seconds."""
    g, ms = cal.card, {k: v * 1e3 for k, v in (cal.split or {}).items()}
    line = (f"calibrated from {cal.source}: {g.name}, peak {g.peak_flops / 1e12:.0f} TFLOP/s and "
            f"{g.hbm_bytes / GB:.1f} GB HBM of the card; efficiencies fitted to the CUDA kernels of its profiled step")
    bw = f"{g.hbm_eff * g.hbm_bw / 1e12:.2f} TB/s ({g.hbm_eff:.2f} of HBM)"
    if not cal.split:
        return line.replace("fitted to the CUDA kernels of its profiled step", "scaled by one factor to its "
                            "median step (no profile.json)"), {"overhead": "in the one factor"}
    return line, {"gemm": f"ceiling {g.gemm_ceiling * g.peak_flops / 1e12:.0f} TFLOP/s ({g.gemm_ceiling:.3f} of peak), "
                          f"fitted to {ms.get('gemm', 0):.1f} ms of GEMM kernels",
                  "attention": f"{g.attn_scale:.3f} x the kernel table, fitted to {ms.get('attention', 0):.1f} ms "
                               f"of attention kernels",
                  "elementwise": f"{bw}, fitted to {ms.get('elementwise', 0):.1f} ms of other kernels",
                  "loss": f"at the fitted {bw}", "grad_accum": f"at the fitted {bw}",
                  "optimizer": f"at the fitted {bw}", "recompute": "at the fitted rates",
                  "launch": "the card's launch cost (not fitted: kernels hide it)",
                  "overhead": f"{cal.overhead_s * 1e3:.1f} ms per step: median step less the kernels",
                  "comm": "the card's links (a one-GPU run measures none)"}
