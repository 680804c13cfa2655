"""training.loss_chunks: the output head and the cross-entropy over chunks of tokens, logits never whole.

The model's forward stops at the final norm (`Llama.head_in_loss`) and the loss calls the head, a
`LossHead`, with the targets: it runs its matmul and the softmax one chunk of tokens at a time, keeps
one log-sum-exp per token, and rebuilds each chunk's logits in backward. The head keeps its parameter
and the hooks other dimensions put on it, which now wrap the loss: TP's entry (a copy of the input,
or under SP a gather of the whole sequence, since the chunks split tokens), ZeRO's gather before it
and release after it.

Under vocabulary parallelism each rank holds a slice of the head's rows (vocab_parallel.py): per chunk
the max and the sums of exponentials and target logits cross the TP group as [tokens] vectors, and
the input gradient each rank gets from its rows is summed by TP's entry in backward.

What one micro-batch holds (N tokens, V rows on this rank, D = model.dim, k chunks, c = N/k):
- saved for backward: the head's input [N, D] (compute dtype; the plain head saves it too; under SP
  the gathered sequence, where the plain fused head saves only this rank's shard), the targets, and
  one fp32 log-sum-exp per token ([N], 4·N bytes). No logits.
- transient, one chunk at a time: forward the chunk's logits [c, V] (compute dtype) and, eager, two
  fp32 [c, V] temporaries (compiled: fused away); backward the chunk's logits and their gradient
  [c, V] (compute dtype each; eager, two fp32 [c, V] temporaries more), beside the input gradient
  [N, D] and the weight gradient [V, D] the plain head's backward makes too.
Time: backward rebuilds the logits, one [N, D]×[D, V] matmul more than the plain head (4 instead of
3; under the zero-bubble split the I and W passes rebuild them each: 5).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from ...distributed.comm import Comm
from ...distributed.functional import all_reduce_max
from ...model.ops import edge, wanted
from ..swap import swap_in


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
                scale: torch.Tensor, z: float = 0.0) -> torch.Tensor:
    """The logits' gradient (softmax - one-hot)·scale, in the logits' dtype; `z` (training.z_loss):
    plus z·mean log² Z's, 2·z·lse·softmax·scale (features/z_loss.py)."""
    p = (logits.to(lse.dtype) - lse[:, None]).exp()
    if z:
        p = p * (lse[:, None] * (2 * z) + 1)
    p = p.scatter_add(1, idx[:, None], -hit.to(p.dtype)[:, None])
    return (p * scale).to(logits.dtype)


_FNS = (_chunk_sums, _chunk_grad)  # element-wise per chunk: compiled under training.compile


class _ChunkedHeadCE(Function):
    """Mean cross-entropy of F.linear(h, w[:valid]) against `targets`, k token chunks at a time."""

    @staticmethod
    def forward(ctx, h, w, targets, chunks: int, start: int, valid: int, comm: Comm | None, fns, zloss=None,
                z: float = 0.0):
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
        ctx.z = z  # the weight, read outside: forward runs without autograd
        if ctx.z:  # training.z_loss from the log-sum-exp kept anyway (features/z_loss.py)
            zloss.record(lse.square().mean(), ctx.z)
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
            d = grad_fn(F.linear(h[lo:hi], real), lse[lo:hi], idx, hit, scale, ctx.z)
            if want_h:
                torch.mm(d, real, out=gh[lo:hi])
            if want_w:
                gw[:valid].addmm_(d.t(), h[lo:hi])
        return gh, gw, None, None, None, None, None, None, None, None


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous token ranges of near-equal size (fewer when there are fewer tokens)."""
    k = max(1, min(chunks, n))
    step = -(-n // k)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


class LossHead(nn.Linear):
    """The output head under training.loss_chunks. The model's forward stops at the final norm
    (`Llama.head_in_loss`) and the loss calls this module with the targets, so its hooks (TP's entry,
    ZeRO's gather and release) wrap the chunked loss as they wrapped the matmul. `start`, `valid`:
    the first vocabulary id and the real rows this rank holds; `comm`: the TP group splitting them;
    `zloss`: training.z_loss's features/z_loss.ZLoss, or None."""
    chunks: int
    start: int
    valid: int
    comm: Comm | None
    fns: tuple
    zloss: object = None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The mean token loss given `targets` [B, S]; the logits without them."""
        if targets is None:
            return super().forward(x)
        return _ChunkedHeadCE.apply(x.flatten(0, 1), edge(self.weight), targets.flatten(), self.chunks,
                                    self.start, self.valid, self.comm, self.fns, self.zloss,
                                    self.zloss.coef if self.zloss is not None else 0.0)


def head_in_loss(model: nn.Module, plan, chunks: int) -> LossHead | None:
    """Make this rank's head (if it holds one) a `LossHead` and end the model's forward before it.
    Before tensor parallelism: under SP the head then gathers its input's sequence whole (the chunks
    split tokens) instead of fusing the gather into its matmul."""
    head = plan.head(model)
    if head is None:  # a pipeline stage without the head never computes the loss
        return None
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"training.loss_chunks: the head is a {type(head).__name__}, not a bias-free nn.Linear")
    model.head_in_loss = True
    return swap_in(model, head, LossHead, chunks=chunks, start=0, valid=model.args.vocab_size, comm=None, fns=_FNS)


def chunked_loss(head: LossHead, vocab, comm: Comm | None, compile: bool, zloss=None) -> Callable:
    """The loss_fn of a model whose head is in the loss: `loss_fn(final-norm output, targets)`.
    `vocab`: the head rows' split (placement.DimSplit), None when the head holds the whole vocabulary
    unpadded; `comm`: the TP group when the rows are split over it; `zloss`: features/z_loss.ZLoss."""
    if vocab is not None:
        head.start, head.valid = vocab.start, vocab.real
    head.comm, head.zloss = comm, zloss
    if compile:
        head.fns = tuple(torch.compile(f, dynamic=False) for f in _FNS)
    return head

