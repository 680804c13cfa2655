"""Apply parallel dimensions to a plain model from outside (module swaps, hooks, wrappers).

`parallelize` turns a meta-device model into this rank's part of the job and returns what the
trainer drives: the model, the optimizer over its masters, and the gradient synchroniser.
The optimizer class comes from the trainer (train/ sits above parallel/); it must accept
`(named_params, optim_cfg, device)` and expose `.params` and `.masters` (fp32, one per param).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config
from ..distributed.mesh import ParallelContext
from ..layout import Layout
from ..model.init import canonical_name, init_source, materialize
from .activation_checkpoint import apply_ac
from .data_parallel import DTYPES, DataParallel, GradBuckets
from .pipeline.build import attach as attach_pipeline, split_model
from .tensor_parallel import apply_tensor_parallel, pad_vocab
from .zero import shard_model

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Mean token loss in fp32. `vocab`: the real vocabulary size; the logits of padded rows
    (model.vocab_multiple) are cut off before the softmax, so padding never changes the loss. Slicing
    before .float() copies nothing extra in eager mode and fuses under compile."""
    if vocab is not None:
        logits = logits[..., :vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _identity(name: str, t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Parallelized:
    """What the trainer drives. Later dimensions replace pieces:
    - `loss_fn(model_output, targets)`: the mean token loss (vocab-parallel under TP);
    - `to_full(name, t)` / `to_local(name, t)`: turn this rank's piece of a named parameter-shaped
      tensor (master, Adam moment) into the full single-process tensor and back. The optimizer's
      `state_tensors()` gives what the rank holds; the trainer maps it through these so checkpoints
      hold full tensors by single-process name and load into any layout (DESIGN invariant 3).
    """
    model: nn.Module
    optimizer: object
    grads: GradBuckets  # begin_step / set_sync / finish / grad_tensors / norm_terms
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    to_full: Callable[[str, torch.Tensor], torch.Tensor] = _identity
    to_local: Callable[[str, torch.Tensor], torch.Tensor] = _identity
    # Pipeline (pp > 1): run all micro-batches of a step / one eval micro-batch on this rank; the
    # loss is the last stage's (zero elsewhere). `pipeline` is the runtime (measured timelines).
    forward_backward: Callable[[torch.Tensor, torch.Tensor, float | torch.Tensor], torch.Tensor] | None = None
    eval_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    pipeline: object | None = None


def named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters once each (tied weights once), under their single-process names."""
    return [(canonical_name(n), p) for n, p in model.named_parameters()]


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config, layout: Layout,
                make_optimizer: Callable) -> Parallelized:
    """`model` was built on the meta device; materialise and wrap it for this rank."""
    pipe = split_model(model, ctx, cfg, layout) if layout.pp > 1 else None  # keep this rank's stages
    apply_ac(model, cfg.training.ac)
    dtype = COMPUTE_DTYPES[cfg.training.precision]
    # tp > 1: the full TP plan (vocab-parallel, padded); tp = 1: only the vocabulary padding, if any
    tp = (apply_tensor_parallel(model, ctx.comm("tp"), cfg.parallel.sp) if layout.tp > 1
          else pad_vocab(model, ctx.comm("tp")))
    materialize(model, cfg.training.seed, ctx.device, dtype=dtype,
                full_shapes=tp.full_shapes if tp else None, slicers=tp.slicers if tp else None,
                source=init_source(cfg.model.init_from, model.args))  # model.init_from = "hf:DIR"
    if cfg.training.compile:
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(block, dynamic=False)
    named = named_params(model)
    zero = shard_model(model, named, ctx, cfg) if cfg.parallel.zero else None  # ZeRO-1/2/3, HSDP
    opt = zero[0] if zero else make_optimizer(named, cfg.optim, ctx.device)
    reduce_dtype = DTYPES[cfg.parallel.reduce_dtype]
    bucket_bytes = int(cfg.parallel.bucket_mb * 2 ** 20)
    dp = ctx.comm("dp")
    if zero:
        grads = zero[1]
    elif dp.size > 1:
        grads: GradBuckets = DataParallel(opt.params, opt.masters, dp, bucket_bytes, reduce_dtype)
    else:
        grads = GradBuckets(opt.params, opt.masters, bucket_bytes, reduce_dtype)
    par = Parallelized(model=model, optimizer=opt, grads=grads)
    if tp is not None:  # checkpoints hold the single-process tensors: unpadded, unsharded
        par.to_full, par.to_local = tp.to_full, tp.to_local
    if layout.tp > 1:
        grads.set_norm_groups(tp.norm_groups(named))
        par.loss_fn = tp.make_loss_fn()
    else:
        par.loss_fn = partial(cross_entropy, vocab=model.args.vocab_size)  # drops padded logits, if any
        if cfg.training.compile:  # the vocab-parallel loss has collectives inside; the plain one fuses well
            par.loss_fn = torch.compile(par.loss_fn, dynamic=False)
    if pipe is not None:
        attach_pipeline(par, pipe, ctx, cfg, layout)
    return par
