"""Data parallelism (zero=0): gradients in flat buckets, all-reduced while backward still runs.

`GradBuckets` owns the gradient storage. Each parameter's gradient lives in a slice of a flat bucket in
the reduction dtype (fp32 by default). When a parameter already has that dtype, `p.grad` *is* the slice
and autograd accumulates into it in place (no copy); otherwise (bf16/fp16 compute) a post-accumulate
hook adds the low-precision gradient into the fp32 slice and frees it, so micro-batch accumulation
happens in fp32. The fp32 master weight's `.grad` is the same slice.

Parameters with different `Reduction`s (grad_sync.py) never share a bucket. On the last micro-batch of a
step, a bucket whose parameters have all reported is all-reduced asynchronously over its group at once
(overlapping the rest of backward); `finish()` waits for all of them, adds the `sum_at_finish` sums and divides
each bucket by its own divisor. Accumulation micro-batches never communicate. With one rank every
collective is a no-op and this is just the gradient storage.
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.comm import Handle  # noqa: F401  (Bucket.handle)
from .grad_sync import Reduction, add_into_view, bind_flat_grads


class Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device, reduction: Reduction):
        self.params, self.reduction = params, reduction
        numel = sum(p.numel() for p in params)
        self.buf = torch.zeros(numel, dtype=dtype, device=device)
        self.views: dict[int, torch.Tensor] = {}
        off = 0
        for p in params:
            self.views[id(p)] = self.buf[off:off + p.numel()].view(p.shape)
            off += p.numel()
        self.pending = len(params)
        self.handle: Handle | None = None


class GradBuckets:
    """Flat gradient storage shared by the model parameters (or their hooks) and the fp32 masters;
    implements `grad_sync.GradSync`."""

    def __init__(self, params: list[nn.Parameter], masters: list[torch.Tensor], reductions: list[Reduction],
                 bucket_bytes: int, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.sync = True
        # Backward visits parameters roughly in reverse registration order: bucket them that way,
        # one run of buckets per reduction.
        elt = torch.tensor([], dtype=dtype).element_size()
        open_: dict[tuple, tuple[list[int], int]] = {}
        self.buckets: list[Bucket] = []
        for i in reversed(range(len(params))):
            key = reductions[i].key
            group, size = open_.get(key, ([], 0))
            group.append(i)
            size += params[i].numel() * elt
            if size >= bucket_bytes:
                self._add(params, group, reductions[i])
                group, size = [], 0
            open_[key] = (group, size)
        for key, (group, _) in open_.items():
            if group:
                self._add(params, group, reductions[group[0]])
        self.bucket_of: dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self.params = params
        views = [self.bucket_of[id(p)].views[id(p)] for p in params]
        for m, view in zip(masters, views):
            m.grad = view
        self.hooks = bind_flat_grads(params, views, self._on_grad)

    def _add(self, params: list[nn.Parameter], group: list[int], reduction: Reduction) -> None:
        self.buckets.append(Bucket([params[j] for j in group], self.dtype, params[group[0]].device, reduction))

    def _on_grad(self, p: nn.Parameter) -> None:
        bucket = self.bucket_of[id(p)]
        add_into_view(p, bucket.views[id(p)])
        if not self.sync:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, b: Bucket) -> None:
        over = b.reduction.all_reduce_over
        b.handle = over[0].all_reduce(b.buf, async_op=True) if over and over[0].size > 1 else None
        b.pending = -1  # launched

    # -- GradSync ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        for b in self.buckets:
            b.buf.zero_()
            b.pending = len(b.params)
            b.handle = None

    def set_sync(self, sync: bool) -> None:
        self.sync = sync

    def finish(self) -> None:
        for b in self.buckets:  # buckets whose parameters got no gradient this step
            if b.pending != -1:
                self._launch(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            for c in b.reduction.all_reduce_over[1:] + b.reduction.sum_at_finish:
                c.all_reduce(b.buf)
            if b.reduction.divisor != 1:
                b.buf.div_(b.reduction.divisor)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [b.buf for b in self.buckets]

    def param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, self.bucket_of[id(p)].views[id(p)]) for p in self.params]

    def held_tensors(self) -> list[torch.Tensor]:
        return self.grad_tensors()

    def release_grads(self) -> None:
        pass
