"""float8 payloads for collectives (training.fp8_comm, docs/fp8.md): the one cast and the byte views every
collective that moves float8 uses (ZeRO-3's weight gather, SP's activation gather; EP's dispatch may).

A float8 tensor travels as its bytes (uint8 views: gloo has no float8 dtype; NCCL moves bytes the same),
so `Comm` books what is really sent: one byte per element. Its scale either is shared (tensorwise:
each rank's amax all-reduced with MAX first, `shared_scales`, so every rank already holds the scale and
none travels) or travels with its rows (`pack_rows` / `unpack_rows`: one fp32 scale per row ahead of
the row's codes).

The arithmetic is torchao's float8 training cast, so a tensor cast here is bit for bit what
torchao's GEMM would have cast from the whole tensor (tests/test_fp8_comm.py checks it against torchao):
scale = max(dtype) / max(amax, EPS) computed in fp64 and rounded to fp32; codes = saturate(x · scale).
torch is the only import: this layer does not need torchao.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import Comm

FLOAT8 = torch.float8_e4m3fn  # the dtype of tensorwise float8 training's inputs and weights
EPS = 1e-12  # the amax floor of torchao's scale rule (an all-zero tensor still gets a finite scale)


def scales_of(amax: torch.Tensor, dtype: torch.dtype = FLOAT8) -> torch.Tensor:
    """The scales that map each amax onto the float8 dtype's largest value (fp32)."""
    return (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty piece: it then never decides a MAX)."""
    return x.abs().amax().float() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def shared_amax(amaxes: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Every rank's amaxes of its pieces, MAX all-reduced (booked as `all_reduce_amax`): each rank then
    holds the whole tensor's (row's, column's) amax, whatever scale rule turns it into a scale."""
    out = amaxes.detach().float().clone()
    if comm.size > 1:
        comm.all_reduce(out, op=dist.ReduceOp.MAX, kind="all_reduce_amax")
    return out


def shared_scales(amaxes: torch.Tensor, comm: Comm, dtype: torch.dtype = FLOAT8) -> torch.Tensor:
    """Each tensor's scale from every rank's amax of its piece (`shared_amax`), so each rank casts its
    piece as the whole tensor would be cast."""
    return scales_of(shared_amax(amaxes, comm), dtype)


def encode(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FLOAT8,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x · scale saturated into `dtype`, as uint8 bytes of x's shape (written into `out` if given);
    `scale` broadcasts (a 0-dim tensor, or one per row)."""
    big = torch.finfo(dtype).max
    codes = (x.to(torch.float32) * scale).clamp(-big, big).to(dtype).view(torch.uint8)
    if out is None:
        return codes
    out.copy_(codes.view(out.shape))
    return out


def decode(codes: torch.Tensor, dtype: torch.dtype = FLOAT8) -> torch.Tensor:
    """The float8 view of uint8 bytes (no copy)."""
    return codes.view(dtype)


def pack_rows(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FLOAT8) -> torch.Tensor:
    """x (rows, n) and its per-row scales (rows, 1) -> (rows, row_bytes(n)) uint8: each row's fp32
    scale, then its codes (padded to 4 bytes, so the scales view as fp32); for collectives whose rows go
    to different ranks (an all-to-all), where no scale can be shared beforehand."""
    rows, n = x.shape
    out = torch.empty(rows, row_bytes(n), dtype=torch.uint8, device=x.device)
    out[:, :4].view(torch.float32).copy_(scale.reshape(rows, 1))
    encode(x, scale.reshape(rows, 1), dtype, out=out[:, 4:4 + n])
    return out


def row_bytes(n: int) -> int:
    """Bytes of one packed row of n elements: 4 for its scale, n codes rounded up to 4."""
    return 4 + -(-n // 4) * 4


def unpack_rows(packed: torch.Tensor, n: int, dtype: torch.dtype = FLOAT8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows from `pack_rows` -> (codes (rows, n) in `dtype`, scales (rows, 1) fp32), both views."""
    return decode(packed[:, 4:4 + n], dtype), packed[:, :4].view(torch.float32)
