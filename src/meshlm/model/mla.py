"""Multi-head latent attention (MLA: DeepSeek-V2 §2.1, DeepSeek-V3), plain PyTorch.

Queries: x → wq (q_lora_rank = 0, DeepSeek-V2-Lite) or wq_a → RMSNorm → wq_b (a q_lora_rank latent);
each head holds qk_nope_head_dim plain dimensions, then qk_rope_head_dim rotated ones. Keys and
values: x → wkv_a = [latent c (kv_lora_rank); k_rope (qk_rope_head_dim)]; c → RMSNorm → wkv_b → per
head [k_nope; v] (v of v_head_dim); k_rope is rotated once and shared by every head (the decoupled
RoPE key). Scores are scaled by 1/√(qk_nope + qk_rope), times YaRN's mscale² when RoPE is YaRN with
mscale_all_dim (DeepSeek's softmax_scale; transformers' `yarn_apply_mscale`).

Training expands c into per-head keys and values and runs the shared attention core (SDPA or flex,
causal / document masks, and the context-parallel cores that replace it). The mscale² factor is
folded into q (the core keeps SDPA's 1/√head size), so every core computes MLA's scores unchanged.

Generation (kv_cache.LatentKV) caches c and the rotated k_rope only, kv_lora_rank + qk_rope_head_dim
numbers per position instead of heads × (qk + v) head sizes, and attends in the latent space with
wkv_b absorbed into the query and the output (DeepSeek-V2 §2.1.2): score = (W_UKᵀ q_nope)·c +
q_rope·k_rope, output = W_UV Σ p·c.

Head counts come from the weight shapes at run time (wkv_b rows / (qk_nope + v)), as in llama.py, so
tensor parallelism only slices weights. RoPE pairs are interleaved, meshlm's layout and DeepSeek's own
(transformers' `rope_interleave = True`): Hugging Face weights load unpermuted.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..core.model_args import ModelArgs
from .layers import AttentionCore, HeadRMSNorm, apply_rope, yarn_mscale

LATENT_NORM_EPS = 1e-6  # DeepSeek's q / kv latent norms keep RMSNorm's default, whatever rms_norm_eps says


class LatentRMSNorm(HeadRMSNorm):
    """RMSNorm of the q or kv latent. Like a per-head norm it is off the residual stream (sequence
    parallelism leaves it alone), and under tensor parallelism with the latent projections replicated
    each rank's backward carries only its heads' share of the gradient (summed over tp)."""


def softmax_mscale(args: ModelArgs) -> float:
    """The factor on MLA's scores beyond 1/√(qk head): YaRN's mscale(factor, mscale_all_dim)²."""
    if args.rope_type != "yarn" or not args.rope_mscale_all_dim:
        return 1.0
    return yarn_mscale(args.rope_factor, args.rope_mscale_all_dim) ** 2


class MLA(nn.Module):
    """Multi-head latent attention with Attention's interface: forward(x, cos, sin, cache, mask)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        heads, r, rank = args.n_heads, args.qk_rope_head_dim, args.kv_lora_rank
        self.nope, self.rope, self.v_dim, self.rank = args.qk_nope_head_dim, r, args.v_head_dim, rank
        qk = self.nope + r
        self.wq = self.wq_a = self.q_a_norm = self.wq_b = None
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_a_norm = LatentRMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, rank + r, bias=False)
        self.kv_a_norm = LatentRMSNorm(rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        self.q_scale = softmax_mscale(args)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        b, s = q.shape[0], q.shape[1]  # not x's: under SP a region's entry gathers x inside the projections
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_rope = self.wkv_a(x).split([self.rank, self.rope], -1)
        latent = self.kv_a_norm(latent)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.reshape(b, s, 1, self.rope), cos, sin)
        if cache is not None:  # generation: a kv_cache.LatentKV
            return self.wo(self._attend_latent(q_nope, q_rope, latent, k_rope[:, :, 0], cache))
        k_nope, v = self.wkv_b(latent).view(b, s, -1, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, q_rope], -1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], -1)
        qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = self.core(*qkv) if mask is None else self.core(*qkv, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def _attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                       k_rope: torch.Tensor, cache) -> torch.Tensor:
        """Attention over the cached latents with wkv_b absorbed (module doc): [b, s, heads·v]."""
        latents, k_ropes, mask = cache.append(latent, k_rope)  # [b, t, rank], [b, t, rope], [s, t] or None
        w = self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.rank)
        q_latent = torch.einsum("bshd,hdr->bshr", q_nope, w[:, :self.nope])
        scores = (torch.einsum("bshr,btr->bsht", q_latent, latents)
                  + torch.einsum("bshd,btd->bsht", q_rope, k_ropes)).float()
        scores = scores * (self.q_scale / math.sqrt(self.nope + self.rope))
        if mask is not None:
            scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
        probs = scores.softmax(-1).type_as(latents)
        out = torch.einsum("bshr,hvr->bshv", torch.einsum("bsht,btr->bshr", probs, latents), w[:, self.nope:])
        return out.flatten(2)
