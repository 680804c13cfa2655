"""Activation checkpointing applied from outside the model.

full: each transformer block keeps only its input; everything inside is recomputed in backward.
selective: only the attention core (softmax(QK^T)V) and the SwiGLU product are recomputed — the
cheap-to-recompute, expensive-to-store parts (Korthikanti et al.).
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    """Runs the wrapped module under non-reentrant checkpointing. The attribute name `_wrapped` is
    stripped from parameter names (model.init.canonical_name), so names stay those of one process."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._wrapped = module

    def forward(self, *args):
        return checkpoint(self._wrapped, *args, use_reentrant=False)


def apply_ac(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    for key, block in list(model.layers.items()):
        if mode == "full":
            model.layers[key] = Checkpointed(block)
        elif mode == "selective":
            block.attention.core = Checkpointed(block.attention.core)
            block.feed_forward.act = Checkpointed(block.feed_forward.act)
        else:
            raise ValueError(f"training.ac: unknown mode '{mode}'")
