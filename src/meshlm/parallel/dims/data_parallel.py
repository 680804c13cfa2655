"""Data parallelism (zero=0): gradients in flat buffers, all-reduced in buckets while backward still runs.

`GradBuckets` owns the gradient storage: one flat buffer in the reduction dtype (fp32 by default) per
group of parameters (`grad_sync.flat_groups`; MasterOptimizer's groups, so that each buffer is the
`.grad` of one flat fp32 master and the optimizer step reads a handful of tensors). Buckets are
contiguous slices of a group's buffer. A parameter's first gradient of a step is copied into its view
(so the buffers are never zero-filled and a bf16 gradient is not added to an fp32 zero), later ones
are added (`grad_sync.accumulate_into_view`); with the buffer's dtype `p.grad` then *is* the view and
autograd accumulates into it in place. A parameter that got no gradient in a step has its view zeroed
before its bucket is reduced.

Parameters with different `Reduction`s (grad_sync.py) never share a bucket. On the last micro-batch of a
step, a bucket whose parameters have all reported is all-reduced asynchronously over its group at once
(overlapping the rest of backward); `finish()` waits for all of them, adds the `sum_at_finish` sums and divides
each bucket by its own divisor. Accumulation micro-batches never communicate. With one rank every
collective is a no-op and this is just the gradient storage.
"""
from __future__ import annotations

import torch
from torch import nn

from ...distributed.comm import Handle  # noqa: F401  (Bucket.handle)
from .grad_sync import Reduction, accumulate_into_view, flat_groups


class Bucket:
    def __init__(self, params: list[nn.Parameter], buf: torch.Tensor, reduction: Reduction):
        self.params, self.reduction, self.buf = params, reduction, buf
        self.views: dict[int, torch.Tensor] = {}
        off = 0
        for p in params:
            self.views[id(p)] = buf[off:off + p.numel()].view(p.shape)
            off += p.numel()
        self.pending = len(params)
        self.handle: Handle | None = None


class GradBuckets:
    """Flat gradient storage for the model parameters and (as whole buffers) the optimizer's flat
    masters; implements `grad_sync.GradSync`. `groups`: the parameters (indices) of each flat buffer,
    in buffer order (default: one per reduction, `flat_groups`); a bucket never spans two groups."""

    def __init__(self, params: list[nn.Parameter], reductions: list[Reduction], bucket_bytes: int,
                 dtype: torch.dtype = torch.float32, groups: list[list[int]] | None = None):
        self.dtype = dtype
        self.sync = True
        groups = groups if groups is not None else flat_groups([r.key for r in reductions],
                                                                [p.numel() for p in params])
        elt = torch.tensor([], dtype=dtype).element_size()
        self.flat: list[torch.Tensor] = []  # one buffer per group
        self.buckets: list[Bucket] = []
        for group in groups:
            buf = torch.zeros(sum(params[i].numel() for i in group), dtype=dtype, device=params[group[0]].device)
            self.flat.append(buf)
            run, size, off = [], 0, 0
            for k, i in enumerate(group):
                run.append(i)
                size += params[i].numel()
                last = k == len(group) - 1
                if last or size * elt >= bucket_bytes or reductions[group[k + 1]].key != reductions[i].key:
                    self.buckets.append(Bucket([params[j] for j in run], buf[off:off + size], reductions[i]))
                    run, off, size = [], off + size, 0
        self.bucket_of: dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self.params = params
        self.first = {id(p): True for p in params}  # no gradient yet this step: copy, don't add
        for p in params:
            p.grad = None
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: nn.Parameter) -> None:
        bucket = self.bucket_of[id(p)]
        accumulate_into_view(p, bucket.views[id(p)], self.first[id(p)])
        self.first[id(p)] = False
        if not self.sync:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, b: Bucket) -> None:
        for p in b.params:  # no gradient this step: its view still holds the last step's
            if self.first[id(p)]:
                b.views[id(p)].zero_()
        over = b.reduction.all_reduce_over
        b.handle = over[0].all_reduce(b.buf, async_op=True) if over and over[0].size > 1 else None
        b.pending = -1  # launched

    # -- GradSync ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        for p in self.params:
            p.grad = None
            self.first[id(p)] = True
        for b in self.buckets:
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
        return self.flat

    def param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, self.bucket_of[id(p)].views[id(p)]) for p in self.params]

    def held_tensors(self) -> list[torch.Tensor]:
        return self.grad_tensors()

    def release_grads(self) -> None:
        pass
