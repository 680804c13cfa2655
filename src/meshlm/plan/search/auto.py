"""`parallel.auto = true`: the trainer asks the planner for the fastest layout of the actual world
size that fits the device, and trains with it (docs/planner.md, "parallel.auto").

The planner chooses every parallel.* key and training.micro_batch / ac; the model, data.seq_len,
training.global_batch and precision stay the user's. Layouts are tried fastest first and the first one
`build_layout` accepts wins (the planner reasons about degrees whose runtime may not exist yet).
Nothing here imports torch: the device comes in as a GPU profile (preflight.py builds it). The entry
(preflight.py) calls `layout_for_run` before a worker trains, so workers never import the planner.
"""
from __future__ import annotations

import dataclasses
import json
import os

from ...core.config import Config, ConfigError, LayoutError
from ...core.layout import Layout, build_layout
from ..cost.estimate import Options, estimate
from ..cluster import check_devices
from ..hardware import GB, GPU, HardwareError, get_gpu
from .ranked import plan
from ..spec import (PlanError, Shape, code_options, priced_on, search_knobs, shape_from_config, spec_from_config,
                    spec_of_layout, to_config)

# A CPU has no profile: the host's RAM is its memory, its measured matmul peak (training.peak_tflops,
# else 0.1 TFLOP/s, assumed) its compute, gloo over loopback its links (1 GB/s, assumed). The choice
# depends on ratios between layouts, not on these absolutes; --calibrate replaces them with a run's.
CPU_PEAK_TFLOPS = 0.1
CPU_LINK_GBPS = 1.0
CPU_EFFICIENCY = 0.5  # the flat model: the per-operation tables are GPU kernels'


def cpu_profile(peak_tflops: float = 0.0) -> GPU:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError, AttributeError):
        ram = 8.0
    return get_gpu("custom", peak_tflops=peak_tflops or CPU_PEAK_TFLOPS, hbm_gb=ram, nvlink_gbps=CPU_LINK_GBPS,
                   ib_gbps=CPU_LINK_GBPS, hbm_tbps=0.01, gpus_per_node=1024)


def predicted_step_s(cfg: Config, world: int, gpu: GPU | None = None) -> float:
    """The step time of `cfg`'s layout on `world` ranks of `gpu` (None: a CPU): the run's length for the
    entry's check of training.energy.trace (preflight.py `check_energy`)."""
    cfg = priced_on(cfg, gpu=gpu is not None)
    o = Options(**code_options(cfg)) if gpu is not None else Options(efficiency=CPU_EFFICIENCY, **code_options(cfg))
    gpu = gpu or cpu_profile(cfg.training.peak_tflops)
    return estimate(shape_from_config(cfg), spec_from_config(cfg, world), gpu, o, validate=False)["step_s"]


def choose_layout(cfg: Config, world: int, gpu: GPU | None = None, o: Options | None = None) -> tuple[Config, dict]:
    """(the config with the chosen layout, a record of the choice and its predicted numbers), or a
    one-line ConfigError when no layout of `world` ranks fits."""
    if cfg.parallel.dp_weights:  # the search prices equal replicas: ParallelConfig.check refuses it in one line
        cfg.parallel.check(cfg)
    cfg = priced_on(cfg, gpu=gpu is not None)  # training.precision / compile "auto": this device's
    if gpu is None:
        gpu = cpu_profile(cfg.training.peak_tflops)
        o = o or Options(efficiency=CPU_EFFICIENCY, **code_options(cfg))
    o = o or Options(**code_options(cfg))
    shape: Shape = shape_from_config(cfg)
    seq, G = cfg.data.seq_len, cfg.training.global_batch
    try:
        res = plan(shape, gpu, world, seq, G * seq, cfg.training.precision, top=20,
                   fixed={"offload": "none"} if gpu.name == "custom" else None, o=o, optim=cfg.optim.name,
                   knobs=search_knobs(cfg))
    except PlanError as e:
        raise ConfigError(f"parallel.auto: {e}") from None
    for r in res.ranked:
        L = r["layout"]
        spec = spec_of_layout(L)
        new = to_config(shape, spec, cfg)
        new.parallel = dataclasses.replace(new.parallel, auto=False)
        try:
            build_layout(new, world)
        except ConfigError:
            continue
        new.parallel = dataclasses.replace(new.parallel, auto=True)
        record = {"auto_layout": spec.short(), "world": world, "gpu": gpu.name,
                  "predicted_step_s": r["step_s"], "predicted_tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                  "predicted_mfu": r["mfu"], "predicted_mem_gib": r["per_gpu"]["total"] / 2 ** 30,
                  "layout": L}
        return new, record
    raise ConfigError(f"parallel.auto: no layout of {world} ranks fits {shape.name or 'the model'} on "
                      f"{gpu.name} with global_batch {G} × seq_len {seq} (see meshlm plan --explain)")


def layout_for_run(cfg: Config, world: int, gpu: GPU | None = None, restarts: int = 0) -> tuple[Layout, dict | None]:
    """(`build_layout`'s Layout, the planner's record of its choice or None). With parallel.auto the
    choice for this world size and device (`gpu`; None: a CPU) is written into `cfg` first, so the
    trainer builds what was chosen; the record holds the choice and its predictions (`log_choice`).

    parallel.elastic = "replan": a configured layout that does not fit `world` (an elastic restart on
    fewer or more ranks) is replaced by the planner's choice for it, the record saying so
    (`replanned_from`); "fail" keeps the one-line ConfigError and, after a restart (`restarts`, the
    count every rank agreed on: distributed/mesh.py `join_world`), says how to allow it. parallel.devices
    is checked against the world first (plan/cluster.py)."""
    try:
        check_devices(cfg, world)
    except HardwareError as e:
        raise ConfigError(str(e)) from None
    if cfg.parallel.auto:
        new, record = choose_layout(cfg, world, gpu)
        cfg.parallel, cfg.training = new.parallel, new.training
        return build_layout(cfg, world), record
    try:
        return build_layout(cfg, world), None
    except LayoutError as e:
        if cfg.parallel.elastic != "replan":
            if cfg.parallel.elastic == "fail" and restarts > 0:
                raise LayoutError(f"{e} (after an elastic resize to {world} ranks; parallel.elastic = "
                                  f"\"replan\" lets the planner pick a layout that fits)") from None
            raise
        before = _short(cfg)
        try:
            new, record = choose_layout(cfg, world, gpu)
        except ConfigError as e2:
            raise ConfigError(f"parallel.elastic: {before} does not fit {world} ranks ({e}) and the planner "
                              f"found none that does: {e2}") from None
        cfg.parallel = dataclasses.replace(new.parallel, auto=False)
        cfg.training = new.training
        return build_layout(cfg, world), dict(record, replanned_from=before, reason=str(e))


def log_choice(record: dict, run_dir: str) -> None:
    """parallel.auto / elastic replan: say what the planner chose and predicted (stdout and
    run_dir/auto_layout.json)."""
    key = "parallel.auto"
    if "replanned_from" in record:
        key = "parallel.elastic"
        print(f"{key}: {record['replanned_from']} does not fit {record['world']} ranks ({record['reason']}): "
              f"replanned", flush=True)
    print(f"{key}: {record['auto_layout']} on {record['world']} × {record['gpu']}: predicted "
          f"{record['predicted_step_s']:.3g} s/step, {record['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s per "
          f"device, MFU {record['predicted_mfu']:.1%}, {record['predicted_mem_gib']:.2f} GiB", flush=True)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "auto_layout.json"), "w") as f:
        json.dump(record, f, indent=1)


def _short(cfg: Config) -> str:
    p = cfg.parallel
    return ", ".join(f"{k} {getattr(p, k)}" for k in ("dp", "tp", "pp", "cp", "ep", "zero") if getattr(p, k) not in (1, -1, 0)) \
        or "dp"
