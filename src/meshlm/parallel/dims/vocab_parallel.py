"""Vocabulary-parallel embedding and cross-entropy (Megatron-LM's vocab-parallel layers).

The embedding table and the output head are split by rows (vocabulary ids) over the TP group. The
vocabulary is padded at the end to `padded_vocab` rows (a multiple of model.vocab_multiple × tp, so
every rank's slice has GEMM-friendly rows); padded rows are never looked up, and their logits are cut
off before the loss, so they get no gradient and never change the loss. The loss never gathers full
logits: each rank reduces its slice to a per-token max, sum of exponentials and target logit, and only
those [tokens]-sized vectors cross the group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from ...distributed.comm import Comm
from ...distributed.functional import all_reduce_max, reduce_from, reduce_scatter_seq
from ..placement import DimSplit


class VocabParallelEmbedding(nn.Module):
    """Looks up the ids this rank holds, zeros elsewhere; the sum over the group is the full lookup.
    Under sequence parallelism the sum is a reduce-scatter along the sequence."""

    def __init__(self, weight: nn.Parameter, comm: Comm, start: int, sp: bool):
        super().__init__()
        self.weight = weight
        self.comm, self.start, self.sp = comm, start, sp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.comm) if self.sp else reduce_from(out, self.comm)


class _VocabParallelCE(Function):
    """Mean cross-entropy over [N, V/t] logit slices. Saves only the local softmax for backward (and,
    under training.z_loss, the per-token log-sum-exp: features/z_loss.py)."""

    @staticmethod
    def forward(ctx, logits, targets, comm, start, valid, zloss=None, z: float = 0.0):
        n, rows = logits.shape
        real = logits[:, :valid]  # padded ids are not part of the vocabulary
        if valid:
            local_max = real.amax(-1)
        else:
            local_max = logits.new_full((n,), float("-inf"))
        shift = all_reduce_max(local_max, comm)
        exp = (real - shift[:, None]).exp()
        hit = (targets >= start) & (targets < start + valid)
        idx = (targets - start).clamp(0, max(valid - 1, 0))
        if valid:
            target_logit = (real.gather(1, idx[:, None]).squeeze(1) - shift) * hit
        else:
            target_logit = logits.new_zeros(n)
        both = torch.stack([exp.sum(-1), target_logit])
        if comm.size > 1:
            comm.all_reduce(both)
        sum_exp, target_logit = both[0], both[1]
        loss = (sum_exp.log() - target_logit).mean()
        exp.div_(sum_exp[:, None])  # softmax of the local slice
        ctx.z = z  # the weight, read outside: forward runs without autograd
        if ctx.z:  # log Z per token from the shards' max and sums: the logits are never gathered
            lse = shift + sum_exp.log()
            zloss.record(lse.square().mean(), ctx.z)
            ctx.save_for_backward(exp, idx, hit, lse)
        else:
            ctx.save_for_backward(exp, idx, hit)
        ctx.rows, ctx.n = rows, n
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, hit = ctx.saved_tensors[:3]
        grad = softmax.new_zeros((ctx.n, ctx.rows))
        valid = softmax.shape[1]
        if valid:
            real = grad[:, :valid]
            real.copy_(softmax)
            if ctx.z:  # d(z·mean log² Z)/d logit = 2·z·log Z·softmax / N
                real.mul_(ctx.saved_tensors[3][:, None] * (2 * ctx.z) + 1)
            real.scatter_add_(1, idx[:, None], -hit.to(grad.dtype)[:, None])
        grad.mul_(g / ctx.n)
        return grad, None, None, None, None, None, None


class VocabParallelLoss:
    """`loss_fn(local_logits [B, S, V/t], targets [B, S])`: the mean token loss, equal to
    F.cross_entropy over the full logits up to summation order. `zloss`: training.z_loss's
    features/z_loss.ZLoss (its term in the gradient, its value recorded there), or None."""

    def __init__(self, comm: Comm, vocab: DimSplit, zloss=None):
        """`vocab`: the rows' split from the placement record (first id, rows held, real ids of them)."""
        self.comm, self.zloss = comm, zloss
        self.start, self.rows, self.valid = vocab.start, vocab.chunk, vocab.real

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != self.rows:
            raise ValueError(f"vocab-parallel loss: expected {self.rows} logits per token, got {logits.shape[-1]}")
        return _VocabParallelCE.apply(logits.flatten(0, 1).float(), targets.flatten(), self.comm,
                                      self.start, self.valid, self.zloss, self.zloss.coef if self.zloss else 0.0)
