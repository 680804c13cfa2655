"""Attention building blocks every attention variant shares (llama.py's grouped-query attention, mla.py's
multi-head latent attention): RMSNorm, RoPE tables and rotation, the SDPA / flex core.

A module of their own so the attention modules and the model that picks between them import downward
only (llama.py re-exports these names).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core.model_args import ROPE_TYPES, ModelArgs
from .flex import flex_attend
from .ops import rms_norm

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.gain(), self.eps)

    def gain(self) -> torch.Tensor:
        """The weight as the forward uses it (sequence parallelism wraps it to sum its gradient)."""
        return self.weight


class HeadRMSNorm(RMSNorm):
    """RMSNorm over each attention head (q/k norm). Not on the residual stream: sequence parallelism
    leaves it alone, and tensor parallelism sums its gradient (each rank holds some of the heads)."""


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """The rotation frequency of each pair [rope_dim/2] (float64), scaled as `args.rope_type` says.

    llama3 (Llama 3.1, transformers' `_compute_llama3_parameters`): wavelengths longer than
    original/low_freq_factor are stretched by `factor`, shorter than original/high_freq_factor kept,
    and those between interpolated smoothly. linear: every frequency divided by `factor`. yarn: below."""
    hd = args.rope_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if args.rope_type == "linear":
        return freqs / args.rope_factor
    if args.rope_type == "llama3":
        low, high, orig = args.rope_low_freq_factor, args.rope_high_freq_factor, args.rope_original_max_seq_len
        wavelen = 2 * math.pi / freqs
        smooth = ((orig / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        scaled = (1 - smooth) * freqs / args.rope_factor + smooth * freqs
        return torch.where(wavelen > orig / low, freqs / args.rope_factor,
                           torch.where(wavelen < orig / high, freqs, scaled))
    if args.rope_type == "yarn":
        return _yarn(freqs, args)
    if args.rope_type != "default":
        raise ValueError(f"rope_type {args.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    return freqs


def _yarn(freqs: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """YaRN (Peng et al. 2023; transformers' `_compute_yarn_parameters`, truncated bounds): pairs that turn
    more than beta_fast times over the original context keep their frequency, those turning fewer
    than beta_slow times are interpolated (÷ factor), a linear ramp over the pair index between."""
    dim, orig = args.rope_dim, args.rope_original_max_seq_len

    def pair(rotations: float) -> float:  # the pair index that turns `rotations` times over `orig`
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(args.rope_theta))

    low = max(math.floor(pair(args.rope_beta_fast)), 0)
    high = min(math.ceil(pair(args.rope_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0.0, 1.0)
    return freqs / args.rope_factor * ramp + freqs * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(args: ModelArgs) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' `attention_factor`): mscale over
    mscale_all_dim when both are set (DeepSeek: 1), else YaRN's own temperature; 1 for other types."""
    if args.rope_type != "yarn":
        return 1.0
    if args.rope_mscale and args.rope_mscale_all_dim:
        return yarn_mscale(args.rope_factor, args.rope_mscale) / yarn_mscale(args.rope_factor, args.rope_mscale_all_dim)
    return yarn_mscale(args.rope_factor)


def rope_tables(freqs: torch.Tensor, max_seq_len: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, pairs] in fp32, times `scale` (rope_attention_factor)."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    if scale != 1.0:
        return (angles.cos() * scale).float(), (angles.sin() * scale).float()
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; rotates interleaved pairs (d0, d1), (d2, d3), ... by position angles."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.type_as(x)


class AttentionCore(nn.Module):
    """The softmax(QK^T)V part alone, a module so selective checkpointing can wrap just it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask (model.attn_impl = flex)
            return flex_attend(q, k, v, mask)
        # Grouped-query attention: SDPA shares each kv head across its q heads without copying them.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=k.shape[1] != q.shape[1])
