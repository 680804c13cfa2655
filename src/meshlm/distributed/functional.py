"""Collectives with autograd, the building blocks of tensor and sequence parallelism.

Megatron's conjugate pairs: entering a tensor-parallel region is the identity forward and an
all-reduce of the gradient backward (`copy_to`); leaving it is an all-reduce forward and the identity
backward (`reduce_from`). Under sequence parallelism the pair becomes all-gather / reduce-scatter along
the sequence (`gather_seq`, `reduce_scatter_seq`), the same bytes with activations 1/t the size in
between. Everything goes through a `Comm`, so the bytes are counted where they are sent.

`gather_linears` fuses the SP entry with the column-parallel linears that read it (Megatron's
sequence-parallel linear): the gathered input is never saved, only this rank's shard; backward
gathers it again (asynchronously, while the input-gradient matmuls run) for the weight gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from ..model.ops import edge, wanted, weight_grad
from .comm import Comm


def all_gather_dim(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (no autograd)."""
    _, finish = _gather_start(x, comm, dim, async_op=False)
    return finish()


def _gather_start(x: torch.Tensor, comm: Comm, dim: int, async_op: bool = True):
    """Start an all-gather of `x` along `dim`; returns (handle, finish) where finish() is the result
    (contiguous: a strided view would be copied by every consumer)."""
    shard = x.movedim(dim, 0).contiguous()
    out = shard.new_empty((comm.size * shard.shape[0],) + tuple(shard.shape[1:]))
    handle = comm.all_gather(out, shard, async_op=async_op)
    return handle, lambda: out.movedim(0, dim).contiguous()


def reduce_scatter_dim(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's 1/size slice along `dim` (no autograd)."""
    full = x.movedim(dim, 0).contiguous()
    if full.shape[0] % comm.size:
        raise ValueError(f"reduce-scatter over '{comm.name}': size {full.shape[0]} along dim {dim} "
                         f"is not divisible by {comm.size}")
    out = full.new_empty((full.shape[0] // comm.size,) + tuple(full.shape[1:]))
    comm.reduce_scatter(out, full)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    # A fresh buffer: gradients handed to backward may be shared with other graph branches.
    out = x.contiguous(memory_format=torch.contiguous_format).clone()
    comm.all_reduce(out)
    return out


class _CopyTo(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.comm), None


class _ReduceFrom(Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SeqCollective(Function):
    """all_gather_dim forward and its conjugate reduce_scatter_dim backward (`gather`), or the reverse:
    sequence parallelism's two moves, one function so the pair cannot drift apart."""

    @staticmethod
    def forward(ctx, x, comm, dim, gather: bool):
        ctx.comm, ctx.dim, ctx.gather = comm, dim, gather
        return (all_gather_dim if gather else reduce_scatter_dim)(x, comm, dim)

    @staticmethod
    def backward(ctx, g):
        return (reduce_scatter_dim if ctx.gather else all_gather_dim)(g, ctx.comm, ctx.dim), None, None, None


class _GatherLinears(Function):
    @staticmethod
    def forward(ctx, x, *args):  # (x, *weights, comm, dim): tensors first, so input i is edge i
        *weights, comm, dim = args
        ctx.comm, ctx.dim = comm, dim
        ctx.save_for_backward(x, *weights)
        full = all_gather_dim(x, comm, dim)
        return tuple(torch.nn.functional.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        want_w = [wanted(ctx, 1 + i) and g is not None for i, g in enumerate(grads)]
        handle, finish = _gather_start(x, ctx.comm, ctx.dim) if any(want_w) else (None, None)
        gx = None
        if wanted(ctx, 0):  # the input gradient while the re-gather is in flight
            gfull = None  # summed in place: Python's sum() would first copy the whole product (0 + g@w)
            for g, w in zip(grads, weights):
                if g is not None:
                    gfull = g @ w if gfull is None else gfull.add_(g @ w)
            gx = reduce_scatter_dim(gfull, ctx.comm, ctx.dim)
        gws = [None] * len(weights)
        if handle is not None:
            handle.wait()
            full = finish()
            gws = [weight_grad(g, full) if w else None for g, w in zip(grads, want_w)]
        return (gx, *gws, None, None)


class _SumGradOverReplicas(Function):
    """Identity forward; backward sums the gradient over the ranks that hold the same replica.

    Rank r holds replica `slot = r // rep` of `n = size // rep`: each rank writes its gradient into
    its slot of a zero buffer, one all-reduce over the whole group sums each slot's replicas, and each
    rank keeps its slot. No sub-groups needed."""

    @staticmethod
    def forward(ctx, w, comm, rep):
        ctx.comm, ctx.rep = comm, rep
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        comm, rep = ctx.comm, ctx.rep
        slot, n = comm.rank // rep, comm.size // rep
        buf = g.new_zeros((n,) + tuple(g.shape))
        buf[slot].copy_(g)
        comm.all_reduce(buf)
        return buf[slot].clone(), None, None


class AllToAll(Function):
    """The exchange forward, its transpose (the splits swapped) backward."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        return exchange(x, comm, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        return exchange(g, ctx.comm, ctx.in_splits, ctx.out_splits), None, None, None


def exchange(x: torch.Tensor, comm: Comm, out_splits, in_splits) -> torch.Tensor:
    x = x.contiguous()
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    comm.all_to_all(out, x, out_splits, in_splits)
    return out


def all_to_all(x: torch.Tensor, comm: Comm, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None) -> torch.Tensor:
    """Rows `in_splits[i]` of x (dim 0) go to peer i and `out_splits[i]` rows arrive from peer i, in rank
    order (None: equal blocks), with autograd. Expert dispatch and Ulysses' head/sequence swaps both
    use it."""
    return AllToAll.apply(x, comm, out_splits, in_splits)


def copy_to(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return x if comm.size == 1 else _CopyTo.apply(x, comm)


def reduce_from(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the partial results forward, identity backward."""
    return x if comm.size == 1 else _ReduceFrom.apply(x, comm)


def gather_seq(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel entry: all-gather along `dim` forward, reduce-scatter backward."""
    return x if comm.size == 1 else _SeqCollective.apply(x, comm, dim, True)


def reduce_scatter_seq(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel exit: reduce-scatter along `dim` forward, all-gather backward."""
    return x if comm.size == 1 else _SeqCollective.apply(x, comm, dim, False)


def gather_linears(x: torch.Tensor, comm: Comm, weights: list[torch.Tensor], dim: int = 1) -> tuple[torch.Tensor, ...]:
    """Sequence-parallel entry fused with the column-parallel linears reading it: F.linear(gather(x), w)
    for each w, saving the shard `x` only (re-gathered in backward)."""
    return _GatherLinears.apply(x, *map(edge, weights), comm, dim)


def sum_grad(w: torch.Tensor, comm: Comm) -> torch.Tensor:
    """A replicated weight used on different data per rank (a norm gain under sequence parallelism):
    its gradient is the sum over the group."""
    return w if comm.size == 1 else _CopyTo.apply(w, comm)


def sum_grad_over_replicas(w: torch.Tensor, comm: Comm, rep: int) -> torch.Tensor:
    """A weight replicated on groups of `rep` consecutive ranks (kv heads when tp > n_kv_heads)."""
    return w if comm.size == 1 or rep == 1 else _SumGradOverReplicas.apply(w, comm, rep)


def all_reduce_max(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Element-wise max over the group, no gradient (the softmax shift of a vocab-parallel loss)."""
    out = x.detach().clone()
    if comm.size > 1:
        comm.all_reduce(out, op=dist.ReduceOp.MAX)
    return out
