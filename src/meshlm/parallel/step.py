"""One optimizer step's forward and backward, whatever the layout: the trainer calls `StepRunner.run`
and reads the gradients after it. Two implementations: `Accumulation` (every layout without pipeline
stages: micro-batches one after another on this rank) and `pipeline.runtime.PipelineRuntime` (the
schedule runs every micro-batch over the stages)."""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from ..data.sampler import Batch
from .dims.grad_sync import GradSync


class StepRunner(Protocol):
    """What `Parallelized.runner` is. `batch`: this rank's share of the global batch, on its device
    (its data-parallel rows, its context-parallel chunk of every sequence)."""

    def run(self, batch: Batch, scale: float | torch.Tensor = 1.0, timed: bool = False) -> torch.Tensor:
        """Forward and backward of every micro-batch of one step. The gradients (of `scale` × each
        micro-batch's mean loss) are reduced and final on return. Returns the sum of the micro-batch
        losses this rank computed (pipeline: zero on every stage but the last). `timed`: record the
        step's timeline (the pipeline's bubble metric; other runners have none)."""

    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """The mean loss of one evaluation micro-batch, no gradients (pipeline: zero on every stage
        but the last)."""


class Counted(Protocol):
    """What keeps per-step statistics of the passes (MoE routing, the MTP and z-loss totals)."""

    def padding(self, on: bool) -> None:
        """`on`: the passes that follow are padding (loss × 0): they must count in nothing."""


class Accumulation:
    """Gradient accumulation: `accum` micro-batches of `micro_batch` rows run one after another; the
    gradient reductions start on the last one's backward (`grads.set_sync`), overlapping it.
    `pad_to`: under parallel.dp_weights where collectives span replicas on every micro-batch (ZeRO-2/3's
    gathers and reduce-scatters, EP's all-to-alls: `Layout.dp_pad_to`), a replica with fewer
    micro-batches runs more of them, weighted 0, so every replica joins the same collectives; `counted`
    are told which passes pad, so no statistic counts them (docs/heterogeneous.md). `accum` and
    `passes` are the full batch's; a step runs as many micro-batches as its batch holds
    (training.batch_rampup: fewer while ramping)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 grads: GradSync, micro_batch: int, accum: int, pad_to: int = 0, counted: Sequence[Counted] = ()):
        self.model, self.loss_fn, self.grads = model, loss_fn, grads
        self.micro_batch, self.accum, self.pad_to = micro_batch, accum, pad_to
        self.passes = max(accum, pad_to)
        self.counted = tuple(counted)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """The mean token loss of one micro-batch (with the autograd graph)."""
        out = self.model(inputs) if docs is None else self.model(inputs, docs=docs)
        return self.loss_fn(out, targets)

    def run(self, batch: Batch, scale: float | torch.Tensor = 1.0, timed: bool = False) -> torch.Tensor:
        inputs, targets, docs = batch
        mb = self.micro_batch
        accum = inputs.shape[0] // mb
        if accum * mb != inputs.shape[0]:
            raise ValueError(f"step: {inputs.shape[0]} sequences do not split into micro-batches of {mb}")
        passes = max(accum, self.pad_to)
        loss_sum = torch.zeros((), device=inputs.device)
        self.grads.begin_step()
        for i in range(passes):
            self.grads.set_sync(i == passes - 1)
            real = i < accum  # a padding pass re-reads the first micro-batch, its gradient times 0
            if i == accum:
                self._padding(True)
            part = slice(i * mb, (i + 1) * mb) if real else slice(0, mb)
            loss = self.loss(inputs[part], targets[part], None if docs is None else docs[part])
            (loss * (scale if real else 0.0)).backward()
            if real:
                loss_sum += loss.detach()
        if passes > accum:
            self._padding(False)
        self.grads.finish()
        return loss_sum

    def _padding(self, on: bool) -> None:
        for c in self.counted:
            c.padding(on)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        return self.loss(*batch)


def local_batch(batch: Batch, local_tokens: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> Batch:
    """This rank's part of a host batch (`local_tokens`: its context-parallel chunks,
    `Parallelized.local_tokens`) on `device`; CUDA: an async copy from pinned memory."""
    def move(x: torch.Tensor) -> torch.Tensor:
        x = local_tokens(x)
        if device.type == "cuda":
            x = x.pin_memory()
        return x.to(device, non_blocking=True)
    return Batch(*(None if x is None else move(x) for x in batch))
