"""The gradient synchroniser interface, shared by DP buckets (data_parallel.py) and ZeRO units (zero/).

Each bucket or unit carries its own `Reduction`: which groups sum its gradient and what it is divided
by. A dimension that changes how gradients are reduced (context parallelism reduces over dp×cp,
expert parameters over their expert-data group, a tied weight also over the two pipeline ends) hands
the parameter another `Reduction` instead of patching a divisor somewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ...distributed.comm import Comm


@dataclass(frozen=True)
class Reduction:
    """`scatter`: ZeRO's shard group (reduce-scatter, then the parameters are gathered over it too);
    None for plain DP. `all_reduce_over`: all-reduced over these as soon as the gradient is ready (DP's group;
    HSDP's replicas after the scatter). `sum_at_finish`: summed once more in `finish()` (copies of one weight
    on two pipeline stages). `divisor`: the number of data-parallel token slices averaged over."""
    scatter: Comm | None
    all_reduce_over: tuple[Comm, ...]
    sum_at_finish: tuple[Comm, ...] = ()
    divisor: int = 1

    @property
    def key(self) -> tuple:
        def names(cs):
            return tuple(c.name for c in cs)
        return (self.scatter.name if self.scatter else None, names(self.all_reduce_over), names(self.sum_at_finish), self.divisor)


FLAT_MAX = 2 ** 30  # elements per flat buffer: offsets stay far inside 32-bit kernel indexing


def flat_groups(keys: list, numels: list[int], cap: int = FLAT_MAX) -> list[list[int]]:
    """Indices of the parameters that share one flat buffer: those of one key, in reverse registration
    order (the order backward produces gradients in; groups too, by their first), cut into runs of at
    most `cap` elements (a larger parameter alone). The DP buffers and MasterOptimizer's flat masters
    use the same groups, so a group's gradient buffer is its master's `.grad` as a whole."""
    by_key: dict = {}
    for i in reversed(range(len(keys))):
        by_key.setdefault(keys[i], []).append(i)
    out = []
    for group in by_key.values():
        run, size = [], 0
        for i in group:
            if run and size + numels[i] > cap:
                out.append(run)
                run, size = [], 0
            run.append(i)
            size += numels[i]
        out.append(run)
    return out


def accumulate_into_view(p: nn.Parameter, view: torch.Tensor, first: bool) -> None:
    """Moves the gradient autograd made for `p` into its view of a flat buffer: copied on the step's
    first backward (the buffer needs no zero fill, and a bf16 gradient is read once, not added to an
    fp32 zero), added on later ones. Then `p.grad` is the view where the dtypes match (autograd adds
    the next micro-batches in place) and None otherwise (the low-precision gradient is freed)."""
    if p.grad is not view:
        if first:
            view.copy_(p.grad)
        else:
            view.add_(p.grad)
    p.grad = view if p.dtype == view.dtype else None


class GradSync(Protocol):
    """What the trainer (and the pipeline runtime) drive, once per optimizer step:
    begin_step → backward passes (set_sync(True) before the last micro-batch's) → finish → read
    grad_tensors / param_grads → optimizer step (→ release_grads)."""

    def begin_step(self) -> None:
        """Zero or drop last step's gradients."""

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the step's last for these gradients (reductions may start)."""

    def finish(self) -> None:
        """Complete every reduction and divide each bucket/unit by its own divisor."""

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient element this rank holds, once (unscaling, clipping, inf checks)."""

    def param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter and this rank's (reduced) gradient of it, as its optimizer piece sees it:
        the whole local tensor for DP, this rank's flat range for ZeRO (empty if none)."""

    def held_tensors(self) -> list[torch.Tensor]:
        """Gradient storage alive before the optimizer step (`mem.grads`)."""

    def release_grads(self) -> None:
        """After the optimizer step."""


def decays(shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether AdamW's weight decay applies to a parameter of this shape: matrices and embeddings do,
    1-D tensors (norm gains, biases) do not, as in Megatron and most Llama recipes. Every optimizer
    (MasterOptimizer, ZeroOptimizer, NvmeOptimizer) asks this, so all layouts decay the same tensors."""
    return len(shape) >= 2
