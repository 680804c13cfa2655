"""The collectives fp8 training moves in float8 (training.fp8_comm, docs/fp8.md), on torchao's side: the
float8 tensors the gathers produce, handed to torchao's GEMM as already cast.

- "zero": ZeRO-3 gathers a unit's float8 weights as float8 (dims/zero/float8.py); `precast` wraps a
  gathered weight for the GEMM (features/float8.py `Float8ZeroLinear`); the routed experts' GEMMs take
  theirs through `Float8Gemms.source` (row-wise scales, one gather per product's orientation).
- "sp": SP's region entry gathers the sequence shards as float8 (`Float8SeqGather`) where only the
  region's column-parallel linears read the input and all of them multiply in float8.
Both need torchao's tensorwise recipe: a tensorwise GEMM casts a weight (an input) with one scale for
the forward and backward GEMMs alike, so the float8 tensor gathered once serves all of them. The
rowwise recipe casts each operand per row for one GEMM and per column for another, which no single
pre-cast tensor is: under it these gathers stay bf16. The casts and byte views are
distributed/float8_comm.py's.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Function

from ...distributed.comm import Comm
from ...distributed.float8_comm import amax, decode, encode, shared_scales
from ...distributed.functional import all_gather_dim, reduce_scatter_dim
from ...core.layout import fp8_comm_in_use


def comm_in_use(training, layout) -> frozenset[str]:
    """The entries of training.fp8_comm this run uses (layout.fp8_comm_in_use)."""
    return fp8_comm_in_use(training.precision, training.fp8_recipe, training.fp8_comm, layout)


def _training_tensor(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, mm_config, weight: bool):
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    role = GemmInputRole.WEIGHT if weight else GemmInputRole.INPUT
    return Float8TrainingTensor(codes, scale, dtype, mm_config, role)


class _Precast(Function):
    """The weight as ZeRO's float8 gather left it: forward wraps the codes and scale (no cast),
    backward hands the weight's gradient to the bf16 parameter unchanged, as torchao's own cast does."""

    @staticmethod
    def forward(ctx, w, codes, scale, mm_config):
        return _training_tensor(codes, scale, w.dtype, mm_config, weight=True)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


def precast(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mm_config) -> torch.Tensor:
    """`w` (the bf16 parameter, for autograd only: its storage may be freed) as the float8 tensor
    (`codes`, `scale`) torchao's GEMM takes without re-casting."""
    return _Precast.apply(w, codes, scale, mm_config)


class Float8SeqGather(Function):
    """SP's region entry in float8: one all-reduce (MAX) of the shards' amax over tp gives every rank the
    scale of the whole gathered input (as torchao's float8 TP does), each shard is cast with it and the
    codes all-gathered as bytes: bit for bit the input the linears would have cast. Forward hands them
    torchao's float8 tensor, multiplied without re-casting and saved (one byte per element) for the weight
    gradient; backward reduce-scatters the input gradient in bf16, as gather_seq does."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: int, mm_config, dtype):
        ctx.comm, ctx.dim = comm, dim
        scale = shared_scales(amax(x).view(1), comm, dtype)[0]
        full = all_gather_dim(encode(x, scale, dtype), comm, dim)
        return _training_tensor(decode(full, dtype), scale, x.dtype, mm_config, weight=False)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim(g, ctx.comm, ctx.dim), None, None, None, None


def gather_entries_in_float8(model: nn.Module, tp) -> int:
    """Turn SP's hooked region entries (tensor_parallel `RegionEntry`) whose readers all multiply in
    float8 into float8 gathers; returns how many. A region with a linear left bf16 (a shape not a
    multiple of 16) keeps the bf16 gather: a bf16 linear cannot take a float8 input."""
    from torchao.float8.float8_linear import Float8Linear

    turned = 0
    for entry in tp.entries:
        readers = [model.get_submodule(fqn) for fqn in entry.readers]
        if not readers or not all(isinstance(m, Float8Linear) for m in readers):
            continue
        mm, dtype = readers[0].linear_mm_config, readers[0].config.cast_config_input.target_dtype
        entry.enter = lambda x, mm=mm, dtype=dtype: Float8SeqGather.apply(x, tp.comm, 1, mm, dtype)
        turned += 1
    return turned
