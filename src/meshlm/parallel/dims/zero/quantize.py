"""Blockwise symmetric int8 quantisation for ZeRO++'s weight gathers and gradient all-to-alls
(docs/zero.md "ZeRO++").

A row of n values is cut into blocks of BLOCK; each block is sent as int8 codes round(x / s) with its
fp32 scale s = absmax / 127 (absmax-symmetric, round to nearest: deterministic, so every rank
dequantises the same values). One packed row is `packed_bytes(n)` bytes: the scales first (4-byte
aligned for the fp32 view), then the n codes; collectives move packed rows as uint8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ....core.facts.quant import QUANT_BLOCK as BLOCK, packed_bytes  # the planner prices the same rows

__all__ = ["BLOCK", "packed_bytes", "quantize_rows", "dequantize_rows"]


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """x (rows, n), any float dtype -> out (rows, packed_bytes(n)) uint8."""
    rows, n = x.shape
    if n % 4:
        raise ValueError(f"quantize: row length {n} is not a multiple of 4 (unit shards are 16-byte aligned)")
    nb = blocks(n)
    xf = F.pad(x.float(), (0, nb * BLOCK - n)).view(rows, nb, BLOCK)
    scale = xf.abs().amax(dim=2) / 127.0
    codes = torch.round(xf / torch.where(scale > 0, scale, 1.0).unsqueeze(2)).clamp_(-127, 127)
    out[:, :4 * nb].view(torch.float32).copy_(scale)
    out[:, 4 * nb:].view(torch.int8).copy_(codes.view(rows, nb * BLOCK)[:, :n])


def dequantize_rows(packed: torch.Tensor, n: int) -> torch.Tensor:
    """packed (rows, packed_bytes(n)) uint8 -> (rows, n) fp32."""
    rows, nb = packed.shape[0], blocks(n)
    scale = packed[:, :4 * nb].view(torch.float32)
    codes = F.pad(packed[:, 4 * nb:].view(torch.int8).float(), (0, nb * BLOCK - n)).view(rows, nb, BLOCK)
    return (codes * scale.unsqueeze(2)).view(rows, nb * BLOCK)[:, :n]
