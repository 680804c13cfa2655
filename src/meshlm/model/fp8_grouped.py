"""The experts' grouped GEMMs in float8 (training.precision = "fp8"; docs/fp8.md, "MoE and expert parallelism").

Row-wise scales as torchao's MoE training (torchao.prototype.moe_training) sets them, each over the
contraction dimension of its product:
- forward x[e] @ w[e]ᵀ: one scale per token row of x and one per output row of w[e] (over `in`);
- input gradient g[e] @ w[e]: one per row of g and one per input column of w[e] (over `out`);
- weight gradient g[e]ᵀ x[e]: one per column of g and of x within each expert's rows (over its tokens).
Every operand is e4m3 (torch._scaled_grouped_mm takes no other), scales are powers of two, so a value
dequantised and quantised again with the same scale is itself (what lets expert parallelism move the
quantised rows and the GEMM take them as they arrive: `Float8Rows`).

On CUDA with torch._scaled_grouped_mm the products run there, each expert's rows padded to a multiple of
16 as torchao pads them; with `emulate` (any device) the operands are quantised, dequantised to fp32 and
multiplied by the ordinary grouped matmul: numerically the same recipe, no speed. Plain PyTorch: the
switch is set from outside (parallel/features/float8.py sets `Experts.gemms`).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from .fp8_kernels import grouped_kernel
from .moe import GroupedGemms, grouped_mm, grouped_wgrad

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
ALIGN = 16  # rows per expert group, and every dimension, of a float8 grouped GEMM


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """The quantising multiplier for each amax: 448/amax rounded down to a power of two (exact to invert)."""
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.float().clamp(min=1e-12))))


def _cast(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data, fp32 dequantising scales with `dim` kept at size 1): one scale per slice along `dim`."""
    s = pow2_scales(x.abs().amax(dim=dim, keepdim=True))
    return _cast(x, s), s.reciprocal()


def group_ids(counts: list[int], device) -> torch.Tensor:
    """The expert of each row: counts[e] rows of e, in order."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device),
                                   torch.tensor(counts, device=device), output_size=sum(counts))


def quantize_group_cols(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] with one scale per column within each expert's rows: (e4m3 data [N, K], fp32
    dequantising scales [E, K])."""
    gid = group_ids(counts, x.device)
    amax = torch.zeros(len(counts), x.shape[1], device=x.device).scatter_reduce_(
        0, gid[:, None].expand(-1, x.shape[1]), x.abs().float(), "amax")
    s = pow2_scales(amax)
    return _cast(x, s[gid]), s.reciprocal()


class Float8Rows(torch.Tensor):
    """Activations quantised per token row (e4m3 `q` [N, d], fp32 `scale` [N, 1]) that autograd sees as a
    `dtype` tensor [N, d]: what expert parallelism's float8 dispatch hands the experts, whose float8 GEMM
    takes `q` and `scale` as they are. Row indexing keeps it quantised; any other op sees the
    dequantised values. Gradients flowing back to it are plain tensors."""
    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=dtype, device=q.device)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q, self.scale = q, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale).to(self.dtype)

    def __repr__(self) -> str:
        return f"Float8Rows(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        x = args[0] if args else None
        if func in (aten.detach.default, aten.alias.default):
            return Float8Rows(x.q, x.scale, x.dtype)
        if func is aten.index.Tensor and len(args[1]) == 1 and not isinstance(args[1][0], Float8Rows):
            return Float8Rows(x.q[args[1][0]], x.scale[args[1][0]], x.dtype)
        plain = tree_map_only(Float8Rows, Float8Rows.dequantize, (args, kwargs or {}))
        return func(*plain[0], **plain[1])


def use_scaled_grouped_mm(x: torch.Tensor, emulate: bool) -> bool:
    """torch._scaled_grouped_mm runs the products: CUDA, not emulated, a torch that has it (one without
    is refused before workers start, fp8_kernels.py check_fp8_device); the CPU has none and emulates (fp8_kernels.py)."""
    return not emulate and grouped_kernel(x.device.type)


def _padding(counts: list[int], device) -> tuple[torch.Tensor | None, int, torch.Tensor]:
    """(each row's place once every expert's rows are padded to ALIGN (None: already aligned), the padded
    row count, the padded groups' end offsets, int32)."""
    padded = [-(-c // ALIGN) * ALIGN for c in counts]
    c, p = torch.tensor(counts, device=device), torch.tensor(padded, device=device)
    offs = p.cumsum(0, dtype=torch.int32)
    if padded == counts:
        return None, sum(counts), offs
    shift = (p.cumsum(0) - p) - (c.cumsum(0) - c)  # where each expert's rows start, padded minus not
    rows = torch.arange(sum(counts), device=device) + torch.repeat_interleave(shift, c, output_size=sum(counts))
    return rows, sum(padded), offs


def _pad(t: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    if rows is None:
        return t
    out = t.new_zeros((n,) + tuple(t.shape[1:]))
    out[rows] = t
    return out


def _rows_product(aq, a_s, bq, b_s, counts: list[int], dtype, kernel: bool) -> torch.Tensor:
    """Expert e's rows of a [N, K] (row scales a_s [N, 1]) times b[e]ᵀ (b [E, n, K], row scales b_s
    [E, n, 1]): [N, n] in `dtype`. The forward and the input gradient."""
    if not kernel:
        return grouped_mm(aq.float() * a_s, bq.float() * b_s, counts).to(dtype)
    rows, n, offs = _padding(counts, aq.device)
    out = torch._scaled_grouped_mm(_pad(aq, rows, n), bq.contiguous().transpose(-2, -1),
                                   _pad(a_s.reshape(-1), rows, n), b_s.reshape(b_s.shape[0], -1).contiguous(),
                                   offs=offs, out_dtype=dtype)
    return out if rows is None else out[rows]


def _wgrad_product(g: torch.Tensor, x: torch.Tensor, counts: list[int], shape, kernel: bool) -> torch.Tensor:
    """Σ over expert e's rows of gᵀx [E, out, in] in g's dtype, both quantised per column within each
    expert's rows."""
    gq, gs = quantize_group_cols(g, counts)
    xq, xs = quantize_group_cols(x, counts)
    if not kernel:
        gid = group_ids(counts, g.device)
        return grouped_wgrad(gq.float() * gs[gid], xq.float() * xs[gid], counts, shape).to(g.dtype)
    rows, n, offs = _padding(counts, g.device)
    return torch._scaled_grouped_mm(_pad(gq, rows, n).t().contiguous(), _pad(xq, rows, n).t().contiguous().t(),
                                    gs.reshape(-1), xs.reshape(-1), offs=offs, out_dtype=g.dtype)


class Float8Gemms(GroupedGemms):
    """GroupedGemms in float8 (the module doc's scales). The input may arrive quantised (`Float8Rows`,
    expert parallelism's float8 dispatch): its rows feed the forward as they are, and backward keeps
    the e4m3 rows and scales instead of a bf16 copy."""

    def __init__(self, emulate: bool):
        self.emulate = emulate
        # ZeRO-3's float8 gather (training.fp8_comm "zero"): source(w, cols) gives w already quantised,
        # (e4m3 codes [E, out, in], dequantising scales [E, out] (cols False) or [E, in] (cols True))
        self.source = None

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.q, x.scale) if isinstance(x, Float8Rows) else (x,)

    def weight(self, w: torch.Tensor, cols: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """w quantised per output row (cols False: the forward's) or per input column (the input
        gradient's, as w[e]ᵀ): as gathered (`source`), else quantised here; the same codes either way."""
        if self.source is None:
            return quantize(w.transpose(1, 2) if cols else w)
        codes, scales = self.source(w, cols)
        return (codes.transpose(1, 2) if cols else codes), scales.unsqueeze(-1)

    def forward(self, x, w, counts):
        xq, xs = (x.q, x.scale) if isinstance(x, Float8Rows) else quantize(x)
        wq, ws = self.weight(w, cols=False)
        return _rows_product(xq, xs, wq, ws, counts, w.dtype, use_scaled_grouped_mm(w, self.emulate))

    def dgrad(self, g, w, counts):
        gq, gs = quantize(g)
        wq, ws = self.weight(w, cols=True)
        return _rows_product(gq, gs, wq, ws, counts, w.dtype, use_scaled_grouped_mm(w, self.emulate))

    def wgrad(self, g, kept, counts, shape):
        x = kept[0] if len(kept) == 1 else kept[0].float() * kept[1]  # exact: power-of-two scales
        return _wgrad_product(g, x, counts, shape, use_scaled_grouped_mm(g, self.emulate))
