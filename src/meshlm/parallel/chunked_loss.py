"""training.loss_chunks: the output head and the cross-entropy over chunks of tokens, logits never whole.

The head module becomes a `DeferredHead` (the same parameter and the same hooks: TP's copy of its
input, ZeRO-1/2's gradient hooks) that hands its input on while gradients are on. The loss then runs
the head's matmul and the softmax one chunk of tokens at a time, keeps one fp32 log-sum-exp per token,
and rebuilds each chunk's logits in backward. Without gradients (evaluation) the head computes whole
logits and the plain loss runs: nothing is saved for a backward there.

Under vocabulary parallelism each rank holds a slice of the head's rows (vocab_parallel.py): per chunk
the max and the sums of exponentials and target logits cross the TP group as [tokens] vectors, and
the input gradient each rank gets from its rows is summed by TP's copy of the head's input.

What one micro-batch holds (N tokens, V rows on this rank, D = model.dim, k chunks, c = N/k):
- saved for backward: the head's input [N, D] (compute dtype; the plain head saves it too), the
  targets, and one fp32 log-sum-exp per token ([N], 4·N bytes). No logits.
- transient, one chunk at a time: forward the chunk's logits [c, V] (compute dtype) and, eager, two
  fp32 [c, V] temporaries (compiled: fused away); backward the chunk's logits and their gradient
  [c, V] (compute dtype each; eager, two fp32 [c, V] temporaries more), beside the input gradient
  [N, D] and the weight gradient [V, D] the plain head's backward makes too.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from ..distributed.comm import Comm
from ..distributed.functional import all_reduce_max
from ..model.ops import edge, wanted


class DeferredHead(nn.Linear):
    """The output head under training.loss_chunks: with gradients on, its input goes to the loss
    (`ChunkedLoss` runs the matmul chunk by chunk); without, the plain linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if torch.is_grad_enabled() else super().forward(x)


def _target_parts(targets: torch.Tensor, start: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's column in this rank's rows (clamped) and whether this rank holds it."""
    hit = (targets >= start) & (targets < start + valid)
    return (targets - start).clamp(0, max(valid - 1, 0)), hit


def _chunk_sums(logits: torch.Tensor, shift: torch.Tensor, idx: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """[2, c]: Σ exp(logit - shift) over the rows, and the target's logit (0 where another rank holds it)."""
    lf = logits.to(shift.dtype)
    target = lf.gather(1, idx[:, None]).squeeze(1) * hit
    return torch.stack([(lf - shift[:, None]).exp().sum(-1), target])


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor, hit: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    """The logits' gradient (softmax - one-hot)·scale, in the logits' dtype."""
    p = (logits.to(lse.dtype) - lse[:, None]).exp()
    p = p.scatter_add(1, idx[:, None], -hit.to(p.dtype)[:, None])
    return (p * scale).to(logits.dtype)


class _ChunkedHeadCE(Function):
    """Mean cross-entropy of F.linear(h, w[:valid]) against `targets`, k token chunks at a time."""

    @staticmethod
    def forward(ctx, h, w, targets, chunks: int, start: int, valid: int, comm: Comm | None, fns):
        n = h.shape[0]
        sums, _ = fns
        real = w[:valid]
        acc = torch.promote_types(h.dtype, torch.float32)  # the softmax's precision: fp32 for 16-bit logits
        lse = h.new_empty(n, dtype=acc)
        tlogit = h.new_empty(n, dtype=acc)
        for lo, hi in _bounds(n, chunks):
            idx, hit = _target_parts(targets[lo:hi], start, valid)
            if valid:
                logits = F.linear(h[lo:hi], real)
                shift = logits.amax(-1).to(acc)
            else:  # a TP rank holding only padded rows
                shift = h.new_full((hi - lo,), float("-inf"), dtype=acc)
            if comm is not None:
                shift = all_reduce_max(shift, comm)
            both = sums(logits, shift, idx, hit) if valid else h.new_zeros(2, hi - lo, dtype=acc)
            if comm is not None and comm.size > 1:
                comm.all_reduce(both)
            lse[lo:hi] = shift + both[0].log()
            tlogit[lo:hi] = both[1]
        ctx.save_for_backward(h, w, targets, lse)
        ctx.chunks, ctx.start, ctx.valid, ctx.fns = chunks, start, valid, fns
        return (lse - tlogit).mean()

    @staticmethod
    def backward(ctx, g):
        h, w, targets, lse = ctx.saved_tensors
        _, grad_fn = ctx.fns
        n, valid = h.shape[0], ctx.valid
        want_h, want_w = wanted(ctx, 0), wanted(ctx, 1)
        gh = (torch.empty_like(h) if valid else torch.zeros_like(h)) if want_h else None
        gw = torch.zeros_like(w) if want_w else None
        real = w[:valid]
        scale = g / n
        for lo, hi in _bounds(n, ctx.chunks) if valid else ():
            idx, hit = _target_parts(targets[lo:hi], ctx.start, valid)
            d = grad_fn(F.linear(h[lo:hi], real), lse[lo:hi], idx, hit, scale)
            if want_h:
                torch.mm(d, real, out=gh[lo:hi])
            if want_w:
                gw[:valid].addmm_(d.t(), h[lo:hi])
        return gh, gw, None, None, None, None, None, None


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous token ranges of near-equal size (fewer when there are fewer tokens)."""
    k = max(1, min(chunks, n))
    step = -(-n // k)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


class ChunkedLoss:
    """`loss_fn(model_output, targets)` for a model whose head is a `DeferredHead`: the model output is
    the head's input [B, S, D] while gradients are on (chunked loss), whole logits otherwise (`plain`)."""

    def __init__(self, head: DeferredHead, chunks: int, plain: Callable, start: int, valid: int,
                 comm: Comm | None, compile: bool = False):
        self.head, self.chunks, self.plain = head, chunks, plain
        self.start, self.valid, self.comm = start, valid, comm
        fns = (_chunk_sums, _chunk_grad)
        self.fns = tuple(torch.compile(f, dynamic=False) for f in fns) if compile else fns

    def __call__(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.plain(out, targets)
        return _ChunkedHeadCE.apply(out.flatten(0, 1), edge(self.head.weight), targets.flatten(), self.chunks,
                                    self.start, self.valid, self.comm, self.fns)


def chunk_the_loss(model: nn.Module, plan, chunks: int, plain: Callable, vocab, comm: Comm | None,
                   compile: bool) -> Callable:
    """Swap this rank's head (if it holds one) for a `DeferredHead` and return the chunked loss.
    `vocab`: the head rows' split (placement.DimSplit), or None when the head holds the whole
    vocabulary unpadded; `comm`: the TP group when the rows are split over it."""
    head = plan.head(model)
    if head is None:  # a pipeline stage without the head never computes the loss
        return plain
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"training.loss_chunks: the head is a {type(head).__name__}, not a bias-free nn.Linear")
    head.__class__ = DeferredHead
    start, valid = (0, model.args.vocab_size) if vocab is None else (vocab.start, vocab.real)
    return ChunkedLoss(head, chunks, plain, start, valid, comm, compile)
