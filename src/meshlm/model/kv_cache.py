"""Key/value cache for generation: each block appends its new keys and values and attends over all
of them. Only `meshlm generate` passes one; training never does, so its numerics are untouched."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .args import ModelArgs


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


class KVCache:
    """Caches of every block of a `Llama`, and the position the next tokens start at."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32):
        shape = (batch, args.n_kv_heads, max_len, args.head_dim)
        self.max_len, self.pos = max_len, 0
        self.layers = {str(i): LayerKV(torch.zeros(shape, device=device, dtype=dtype),
                                       torch.zeros(shape, device=device, dtype=dtype))
                       for i in range(args.n_layers)}

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.pos, self.pos + seq_len, device=device)

    def advance(self, seq_len: int) -> None:
        self.pos += seq_len
        for layer in self.layers.values():
            layer.start = self.pos
