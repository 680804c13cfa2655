"""Apply parallel dimensions to a plain model from outside (module swaps, hooks, wrappers).

`parallelize` turns a meta-device model into this rank's part of the job and returns what the
trainer drives: the model, the optimizer over its masters, and the gradient synchroniser.
The optimizer class comes from the trainer (train/ sits above parallel/); it must accept
`(named_params, optim_cfg, device)` and expose `.params` and `.masters` (fp32, one per param).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..config import Config
from ..distributed.comm import Comm
from ..distributed.mesh import ParallelContext
from ..layout import Layout
from ..model.init import canonical_name, materialize
from .activation_checkpoint import apply_ac
from .data_parallel import DTYPES, DataParallel, GradBuckets

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Parallelized:
    model: nn.Module
    optimizer: object
    grads: GradBuckets  # begin_step / set_sync / finish / grad_tensors
    norm_comms: list[Comm] = field(default_factory=list)  # groups that shard the gradients
    inf_comms: list[Comm] = field(default_factory=list)  # groups whose ranks must agree on skipping


def named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters once each (tied weights once), under their single-process names."""
    return [(canonical_name(n), p) for n, p in model.named_parameters()]


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config, layout: Layout,
                make_optimizer: Callable) -> Parallelized:
    """`model` was built on the meta device; materialise and wrap it for this rank."""
    apply_ac(model, cfg.training.ac)
    dtype = COMPUTE_DTYPES[cfg.training.precision]
    materialize(model, cfg.training.seed, ctx.device, dtype=dtype)
    if cfg.training.compile:
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(block)
    named = named_params(model)
    opt = make_optimizer(named, cfg.optim, ctx.device)
    reduce_dtype = DTYPES[cfg.parallel.reduce_dtype]
    bucket_bytes = int(cfg.parallel.bucket_mb * 2 ** 20)
    dp = ctx.comm("dp")
    if dp.size > 1:
        grads: GradBuckets = DataParallel(opt.params, opt.masters, dp, bucket_bytes, reduce_dtype)
    else:
        grads = GradBuckets(opt.params, opt.masters, bucket_bytes, reduce_dtype)
    return Parallelized(model=model, optimizer=opt, grads=grads, inf_comms=[dp])
