"""Activation checkpointing applied from outside the model, to the modules the model plan names.

full: each transformer block keeps only its input; everything inside is recomputed in backward.
selective: only the attention core (softmax(QK^T)V) and the SwiGLU product are recomputed — the
cheap-to-recompute, expensive-to-store parts (Korthikanti et al.).
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..choices import AC_MODES, choose


class Checkpointed(nn.Module):
    """Runs the wrapped module under non-reentrant checkpointing. The attribute name `_wrapped` is
    stripped from parameter names (model.init.canonical_name), so names stay those of one process."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._wrapped = module

    def forward(self, *args):
        return checkpoint(self._wrapped, *args, use_reentrant=False)


def apply_ac(model: nn.Module, mode: str, plan=None) -> None:
    """Wrap the modules the model plan names for `mode` (parallel/llama_plan.py `ac_targets`; default:
    the model's own plan)."""
    choose(mode, AC_MODES, "training.ac")
    if plan is None:
        from .moe_plan import plan_for
        plan = plan_for(model)
    for parent, attr in plan.ac_targets(model, mode):
        setattr(parent, attr, Checkpointed(getattr(parent, attr)))
