"""Key/value cache for generation: each block appends its new keys and values and attends over all
of them. Only `meshlm generate` passes one; training never does, so its numerics are untouched.
Multi-head latent attention (model/mla.py) caches its compressed latent and RoPE key instead
(`LatentKV`), and attends over them itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.model_args import ModelArgs


class LayerKV:
    """One block's keys and values [B, kv_heads, max_len, head_dim], filled up to `start`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.start = k, v, 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [B, heads, S, D] of the new positions start .. start+S-1."""
        s, end = q.shape[2], self.start + q.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"kv cache: {end} positions exceed its length {self.k.shape[2]}")
        self.k[:, :, self.start:end] = k
        self.v[:, :, self.start:end] = v
        keys, values = self.k[:, :, :end], self.v[:, :, :end]
        mask = None
        if s > 1:  # new position start+i sees keys 0 .. start+i
            mask = torch.ones(s, end, dtype=torch.bool, device=q.device).tril(self.start)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=keys.shape[1] != q.shape[1])


class LatentKV:
    """One MLA block's cache: the normalised kv latent [B, max_len, kv_lora_rank] and the rotated RoPE key
    [B, max_len, qk_rope_head_dim] of every position, filled up to `start` (no per-head keys or values)."""

    def __init__(self, latent: torch.Tensor, k_rope: torch.Tensor):
        self.latent, self.k_rope, self.start = latent, k_rope, 0

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor):
        """Store the new positions start .. start+S-1; returns every cached latent and RoPE key so far and
        the causal mask [S, end] of the new positions (None for one position: it sees them all)."""
        s, end = latent.shape[1], self.start + latent.shape[1]
        if end > self.latent.shape[1]:
            raise ValueError(f"kv cache: {end} positions exceed its length {self.latent.shape[1]}")
        self.latent[:, self.start:end] = latent
        self.k_rope[:, self.start:end] = k_rope
        mask = torch.ones(s, end, dtype=torch.bool, device=latent.device).tril(self.start) if s > 1 else None
        return self.latent[:, :end], self.k_rope[:, :end], mask


class KVCache:
    """Caches of every block of a `Llama`, and the position the next tokens start at."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32):
        if args.mla:
            shapes, kind = [(batch, max_len, args.kv_lora_rank), (batch, max_len, args.qk_rope_head_dim)], LatentKV
        else:
            shapes, kind = [(batch, args.n_kv_heads, max_len, args.head_dim)] * 2, LayerKV
        self.max_len, self.pos = max_len, 0
        self.layers = {str(i): kind(*(torch.zeros(s, device=device, dtype=dtype) for s in shapes))
                       for i in range(args.n_layers)}

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.pos, self.pos + seq_len, device=device)

    def advance(self, seq_len: int) -> None:
        self.pos += seq_len
        for layer in self.layers.values():
            layer.start = self.pos
