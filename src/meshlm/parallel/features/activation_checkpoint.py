"""Activation checkpointing applied from outside the model, to the modules the model plan names.

full: each transformer block keeps only its input; everything inside is recomputed in backward.
op: each block runs under per-op selective checkpointing (torch's `create_selective_checkpoint_contexts`,
as torchtitan's op-level SAC): the outputs of matmuls and of the attention kernel are kept, the
cheap element-wise work between them (norms, RoPE, residual adds, the SwiGLU product) is recomputed.
selective: only the attention core (softmax(QK^T)V) is recomputed (Korthikanti et al.; the SwiGLU
product is never saved since model/ops.py).
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ...core.choices import AC_MODES, choose
from ...model.ops import eager_under_compile

_aten = torch.ops.aten
# The ops whose outputs `op` mode keeps: matmuls (_scaled_mm: fp8's float8 GEMMs) and attention kernels
# (whichever SDPA picks).
SAVED_OPS = frozenset(getattr(_aten, n).default for n in (
    "mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, n))


class _OpPolicy:
    """Keep matmul and attention outputs, recompute the rest; in eager runs also count the bytes kept
    (SAC holds them in its own cache, out of reach of saved-tensor hooks). Called at trace time under
    compile (nothing to count then: the partitioner's saved tensors are visible to the hooks)."""

    def __init__(self):
        self.kept_bytes = 0
        self._kept: set[int] = set()

    def reset(self) -> None:
        self.kept_bytes, self._kept = 0, set()

    def __call__(self, ctx, op, *args, **kwargs):
        if op not in SAVED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute and not torch.compiler.is_compiling():
            for t in (ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self._kept:
                    self._kept.add(t.untyped_storage().data_ptr())
                    self.kept_bytes += t.untyped_storage().nbytes()
        return CheckpointPolicy.MUST_SAVE


class Checkpointed(nn.Module):
    """Runs the wrapped module under non-reentrant checkpointing. The attribute name `_wrapped` is
    stripped from parameter names (model.init.canonical_name), so names stay those of one process."""

    def __init__(self, module: nn.Module, per_op: bool = False):
        super().__init__()
        self._wrapped = module
        self._policy = _OpPolicy() if per_op else None
        self._kw = {"context_fn": functools.partial(create_selective_checkpoint_contexts, self._policy)} \
            if per_op else {}

    @property
    def kept_bytes(self) -> int:
        """op mode: bytes the last eager forward kept in the op cache."""
        return self._policy.kept_bytes if self._policy is not None else 0

    def forward(self, *args):
        if self._policy is not None:
            self._reset()
        return checkpoint(self._wrapped, *args, use_reentrant=False, **self._kw)

    @eager_under_compile  # runs each step even when compiled (a region dynamo cannot trace runs eagerly)
    def _reset(self) -> None:
        self._policy.reset()


def apply_ac(model: nn.Module, mode: str, plan=None) -> None:
    """Wrap the modules the model plan names for `mode` (parallel/model_plans/llama.py `ac_targets`; default:
    the model's own plan)."""
    choose(mode, AC_MODES, "training.ac")
    if plan is None:
        from ..model_plans.moe import model_plan_for
        plan = model_plan_for(model)
    for parent, attr in plan.ac_targets(model, mode):
        setattr(parent, attr, Checkpointed(getattr(parent, attr), per_op=mode == "op"))
