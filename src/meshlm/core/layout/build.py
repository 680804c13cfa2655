"""`build_layout`: a config on a world size becomes a checked `Layout`, or one line naming the key."""
from __future__ import annotations

from ..config import AUTO, Config, LayoutError, apply_device, check_device_keys
from ..config.model import check_export, model_args
from .checks import (check_pipeline, check_cp, check_dp_weights, check_ep, check_fp8, check_islands, check_mtp,
                     check_rampup, check_shape, check_zeropp)
from .degrees import Layout, from_config



def build_layout(cfg: Config, world_size: int) -> Layout:
    """The layout for `world_size` ranks, or a ConfigError naming the offending key.

    With parallel.auto the planner chooses the layout first: the entry calls plan/search/auto.py
    `layout_for_run`, which writes the choice into `cfg` and then calls this (core sits below both
    buildings: docs/architecture.md). Device keys still "auto" (training.precision, compile,
    model.attn_impl) while training.precision or compile is still "auto" are those of a CPU here: the
    entry resolves them for the device that trains first (distributed/mesh.py `device_defaults`, which
    needs torch), and the planner for the device it prices."""
    if AUTO in (cfg.training.precision, cfg.training.compile):
        apply_device(cfg, cuda=False)
    else:
        check_device_keys(cfg.training)
    p = cfg.parallel
    args = model_args(cfg)
    cfg.check()
    if world_size < 1:
        raise LayoutError(f"--nproc: must be >= 1, got {world_size}")
    layout = from_config(cfg, world_size)
    layout.check_groups()
    check_shape(args, p.tp, p.pp, p.pp_virtual)
    # sp splits the sequence over the tp group; at tp = 1 it is a no-op (docs/tensor_parallel.md)
    if layout.sp_enabled and cfg.data.seq_len % p.tp:
        raise LayoutError(f"parallel.sp: data.seq_len {cfg.data.seq_len} is not divisible by tp {p.tp}")
    check_cp(args, layout, p.cp_impl, cfg.data.seq_len)
    check_ep(args, layout)
    check_fp8(cfg, args)
    check_mtp(cfg, args)
    check_zeropp(layout, p.offload)
    check_dp_weights(cfg, args, layout)
    check_islands(cfg, args, layout)
    for m in check_rampup(cfg, layout):  # every step's micro-batch count (the pipeline runs each)
        if layout.pp_enabled or p.pp_virtual > 1 or p.pp_layers:
            check_pipeline(cfg, args, m)
    check_export(cfg, args)
    return layout
