"""Reduce-scatter, all-gather and all-reduce over gloo as one all-to-all hop each (docs/architecture.md,
"Collectives on gloo").

gloo runs its collectives as rings: a reduce-scatter or all-gather is n-1 dependent hops and an
all-reduce 2(n-1), each a rendezvous of a few messages handed between threads. On a CPU host with more
ranks than cores that hand-off, not the bytes, is the cost: measured on two cores, a 16 KiB all-reduce
took 1.2 ms over 2 ranks and 5 ms over 4, where one all-to-all of the same bytes took 0.14 ms and 2.3 ms.
The direct algorithms below move the same bytes per rank as the ring, (n-1)/n of the tensor for each
phase, in one hop: every rank sends each peer the slice that peer owns, and sums what it receives in
rank order. So every rank of a group computes an element's sum in the same order (bitwise the same
result on all of them), and over two ranks the result is gloo's own bit for bit (a+b = b+a).

NCCL groups never come here: NCCL picks its own algorithms per message size.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

# What the direct algorithms reduce with; another op (gloo has no AVG) takes gloo's own collective.
_FOLD = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum,
         dist.ReduceOp.PRODUCT: torch.mul}


# An all-reduce this small is one all-gather of the whole tensor: its latency, not its bytes, is the cost.
ONE_HOP_BYTES = 64 * 1024


def enabled() -> bool:
    """MESHLM_GLOO_RING=1 keeps gloo's own ring algorithms (to compare, or to bisect a suspect)."""
    return os.environ.get("MESHLM_GLOO_RING", "") not in ("1", "true", "yes")


def supports(op) -> bool:
    return op in _FOLD


def fold(chunks: torch.Tensor, op, out: torch.Tensor) -> None:
    """out <- chunks[0] op chunks[1] op ... in rank order, rounded in the tensor's dtype at each step
    (as a ring rounds at each hop)."""
    acc = chunks[0].clone()
    for c in chunks[1:]:
        _FOLD[op](acc, c, out=acc)
    out.copy_(acc.view(out.shape))


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, size: int, op, swap, async_op: bool):
    """Start out <- this rank's slice of the reduction of every rank's `full`; returns (work, finish):
    `finish()` does the local reduction once the work is done (at once when not async). `swap(recv,
    send, async_op)`: the group's all-to-all of equal blocks (`Comm._swap`)."""
    recv = torch.empty(full.numel(), dtype=full.dtype, device=full.device)
    work = swap(recv, full.reshape(-1).contiguous(), async_op)

    def finish() -> None:
        fold(recv.view(size, -1), op, out)
    return work, finish


def all_gather(out: torch.Tensor, shard: torch.Tensor, size: int, swap, async_op: bool):
    """Start out <- every rank's shard in rank order (each rank sends its shard to every peer)."""
    flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
    sent = shard.reshape(1, -1).expand(size, -1).contiguous().view(-1)
    work = swap(flat, sent, async_op)

    def finish() -> None:
        if flat.data_ptr() != out.data_ptr():
            out.copy_(flat.view(out.shape))
    return work, finish


def all_reduce(t: torch.Tensor, size: int, op, swap) -> None:
    """t <- the reduction over the group, synchronously. Up to ONE_HOP_BYTES every rank gathers every
    rank's whole tensor and folds them all (one hop, n-1 copies sent instead of 2(n-1)/n of one);
    above, a reduce-scatter then an all-gather, both direct (padded to a multiple of the group's size).
    Only synchronous: a second collective started when an async handle is waited on could start in
    another order on another rank."""
    n = t.numel()
    if n * t.element_size() <= ONE_HOP_BYTES:
        every = torch.empty(size * n, dtype=t.dtype, device=t.device)
        all_gather(every, t, size, swap, False)[1]()
        fold(every.view(size, -1), op, t)
        return
    k = -(-n // size)
    full = torch.zeros(k * size, dtype=t.dtype, device=t.device)
    full[:n].copy_(t.reshape(-1))
    mine = torch.empty(k, dtype=t.dtype, device=t.device)
    reduce_scatter(mine, full, size, op, swap, False)[1]()
    all_gather(full, mine, size, swap, False)[1]()
    t.copy_(full[:n].view(t.shape))
