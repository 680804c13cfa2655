"""`resolve`: a config on a world size becomes a checked `Layout`, or one line naming the key."""
from __future__ import annotations

from ..config import Config, LayoutError, resolve_auto
from ..model.from_config import check_export, model_args
from .checks import (_check_pipeline, check_cp, check_dp_weights, check_ep, check_fp8, check_islands, check_mtp,
                     check_rampup, check_shape, check_zeropp)
from .degrees import Layout, from_config


def device_defaults(cfg: Config) -> Config:
    """training.precision / compile and model.attn_impl = "auto" resolved for the device training.device
    names (in place):
    a CUDA device, with or without bf16, or a CPU. A GPU job resolves on every rank, each for its own."""
    t = cfg.training
    if "auto" not in (t.precision, t.compile, cfg.model.attn_impl):  # nothing to probe (still checked)
        return resolve_auto(cfg, False)
    import torch
    kind = t.device
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    # bf16 support is asked only where it decides something (precision "auto")
    bf16 = t.precision == "auto" and cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return resolve_auto(cfg, cuda, bf16)


def resolve(cfg: Config, world_size: int) -> Layout:
    """The layout for `world_size` ranks, or a ConfigError naming the offending key.

    With parallel.auto the planner chooses the layout first: callers go through plan.auto.resolve,
    which writes the choice into `cfg` and then calls this (layout sits below plan: docs/architecture.md)."""
    device_defaults(cfg)
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
            _check_pipeline(cfg, args, m)
    check_export(cfg, args)
    return layout
