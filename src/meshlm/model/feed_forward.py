"""The dense SwiGLU feed-forward and the product alone (what MoE experts run), below both llama.py and
moe.py so neither imports the other's module."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops import swiglu_down


class SwiGLU(nn.Module):
    """silu(gate) * up, a module so selective checkpointing can recompute it instead of saving it (MoE
    experts; the dense FeedForward fuses it into w2 instead)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.w2) is not nn.Linear:  # swapped for a linear that multiplies its own way (fp8's
            return self.w2(F.silu(self.w1(x)) * self.w3(x))  # Float8Linear): reading its weight would skip that
        # w2(silu(gate)·up) in one node: the product is rebuilt in backward, never saved (model/ops.py)
        return swiglu_down(self.w1(x), self.w3(x), self.w2.weight)
