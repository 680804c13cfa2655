"""Data parallelism (zero=0): gradients in flat buckets, all-reduced while backward still runs.

`GradBuckets` owns the gradient storage. Each parameter's gradient lives in a slice of a flat bucket in
the reduction dtype (fp32 by default). When a parameter already has that dtype, `p.grad` *is* the slice
and autograd accumulates into it in place (no copy); otherwise (bf16/fp16 compute) a post-accumulate
hook adds the low-precision gradient into the fp32 slice and frees it, so micro-batch accumulation
happens in fp32. The fp32 master weight's `.grad` is the same slice.

`DataParallel` adds communication: on the last micro-batch of a step, a bucket whose parameters have
all reported is all-reduced asynchronously at once (overlapping the rest of backward); `finish()`
waits for all of them and averages. Accumulation micro-batches never communicate.
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.comm import Comm, Handle

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device):
        self.params = params
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
    """Flat gradient storage shared by the model parameters (or their hooks) and the fp32 masters."""
    norm_groups: list[tuple[list[int], list[Comm]]] | None = None  # set_norm_groups

    def __init__(self, params: list[nn.Parameter], masters: list[torch.Tensor], bucket_bytes: int,
                 dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        # Backward visits parameters roughly in reverse registration order: bucket them that way.
        order = list(reversed(range(len(params))))
        self.buckets: list[Bucket] = []
        group: list[int] = []
        size = 0
        elt = torch.tensor([], dtype=dtype).element_size()
        for i in order:
            group.append(i)
            size += params[i].numel() * elt
            if size >= bucket_bytes:
                self.buckets.append(Bucket([params[j] for j in group], dtype, params[i].device))
                group, size = [], 0
        if group:
            self.buckets.append(Bucket([params[j] for j in group], dtype, params[group[0]].device))
        self.bucket_of: dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self.hooks = []
        for p, m in zip(params, masters):
            view = self.bucket_of[id(p)].views[id(p)]
            if p.dtype == dtype:
                p.grad = view  # autograd accumulates straight into the bucket
            m.grad = view
            self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: nn.Parameter) -> None:
        bucket = self.bucket_of[id(p)]
        view = bucket.views[id(p)]
        if p.grad is not view:
            view.add_(p.grad)
            p.grad = None
        self.on_ready(bucket)

    def on_ready(self, bucket: Bucket) -> None:
        """A parameter of `bucket` finished accumulating this micro-batch (DataParallel overrides)."""

    def zero(self) -> None:
        for b in self.buckets:
            b.buf.zero_()
            b.pending = len(b.params)
            b.handle = None

    # The interface the trainer drives, also implemented by DataParallel and ZeRO.
    def begin_step(self) -> None:
        self.zero()

    def set_sync(self, sync: bool) -> None:
        pass

    def finish(self) -> None:
        pass

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient element this rank holds, once (for unscaling, clipping, inf checks)."""
        return [b.buf for b in self.buckets]

    def set_norm_groups(self, groups: list[tuple[list[nn.Parameter], list[Comm]]]) -> None:
        """Tensor parallelism: which parameters are sharded over which comms. A parameter in no group
        is a replica that another rank counts (the same groups, in the same order, on every rank)."""
        self.norm_groups = [([id(p) for p in params], comms) for params, comms in groups]

    def held_tensors(self) -> list[torch.Tensor]:
        """Gradient storage alive before the optimizer step, for `mem.grads` (ZeRO overrides)."""
        return self.grad_tensors()

    def norm_terms(self) -> list[tuple[list[torch.Tensor], list[Comm]]]:
        """Groups of gradients and the comms they are sharded over: the global squared norm is, per
        group, the sum of squares all-reduced over those comms (replicated copies counted once)."""
        if self.norm_groups is None:
            return [(self.grad_tensors(), [])]
        return [([self.bucket_of[i].views[i] for i in ids], comms) for ids, comms in self.norm_groups]


class DataParallel(GradBuckets):
    def __init__(self, params, masters, comm: Comm, bucket_bytes: int, dtype: torch.dtype = torch.float32):
        super().__init__(params, masters, bucket_bytes, dtype)
        self.comm = comm
        self.sync = True

    def set_sync(self, sync: bool) -> None:
        self.sync = sync

    def on_ready(self, bucket: Bucket) -> None:
        if not self.sync:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.handle = self.comm.all_reduce(bucket.buf, async_op=True)

    def finish(self) -> None:
        for b in self.buckets:  # buckets whose parameters got no gradient this step
            if b.handle is None:
                b.handle = self.comm.all_reduce(b.buf, async_op=True)
        for b in self.buckets:
            b.handle.wait()
            b.buf.div_(self.comm.size)
