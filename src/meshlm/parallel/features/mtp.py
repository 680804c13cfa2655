"""Multi-token prediction in training (model.mtp_depth > 0; DeepSeek-V3 §2.2, model/mtp.py) in every
layout: the layout's loss function gains the MTP term, and neither the step runners, the pipeline
stages nor the loss kernels know.

`MTPLoss(out, targets)` is the layout's own loss of the main head (plain, vocab-parallel, chunked)
plus `training.mtp_loss_weight` × the MTP loss in the gradient only: it returns
main + w·(mtp − mtp.detach()), whose value is the main loss exactly. So metrics.jsonl `loss` keeps its
meaning in every layout (the language-model loss, which Megatron also reports apart from its MTP
losses), and `mtp_loss` (the unweighted mean over depths) is reported beside it from `total`.

The MTP modules start from the final norm's output h, which a forward hook on the final norm keeps (the
stage holding the head holds the MTP modules and a copy of the embedding, pipeline `prune`), with the
positions and document ids the model's forward was given (a pre-hook registered after SP's and CP's).
Depth k at position p embeds token p + k (the target at p + k − 1; past the end, the last target again,
as model/mtp.py) and predicts the target at p + k, for the positions p < S − k.

Context parallelism: a rank holds chunks of each sequence and the tokens ahead of a chunk's end live
on another rank, so the micro-batch's targets are all-gathered over cp (B·S integers) and each rank
picks its positions. Each depth's loss is the loss function's mean over this rank's positions that
have a target, times their share n·cp/(S − k) of the sequence's S − k, so the mean over the cp ranks
(the gradient reduction, the reported loss) is one process's. Under SP the head's entry gathers the
(CP-local) sequence, so positions are picked from whole rows; the chunked loss head takes its input
before that gather, which is why core/layout/checks.py refuses MTP with training.loss_chunks under SP.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from ...distributed.functional import all_gather_dim
from ..dims.context_parallel import ContextParallel
from ..dims.cp_allgather import sequence_order
from ..model_plans.llama import MTPParts
from .z_loss import ZLoss


class MTPLoss:
    """The loss function of a model with MTP modules (module doc); `total`: the step's sum of this
    rank's unweighted MTP losses (None before any; zero on stages without the head)."""

    def __init__(self, model: nn.Module, parts: MTPParts, loss_fn: Callable, weight: float,
                 cp: ContextParallel | None, zloss: ZLoss | None = None):
        """`parts`: the model's pieces by role (the model plan's `mtp_parts`: only the plan knows their
        names); `zloss`: training.z_loss, which the main head's loss gets and the MTP heads' do not."""
        self.parts, self.loss_fn, self.weight, self.cp, self.zloss = parts, loss_fn, weight, cp, zloss
        self.depth = len(parts.modules)
        self.h = self.positions = self.docs = None
        self.total: torch.Tensor | None = None
        self._padding = False  # padding passes (parallel/step.py) add nothing to `total`
        self._picks: dict[tuple[int, int], tuple] = {}
        if parts.final_norm is not None:  # the stage with the head (every stage calls the model's forward)
            parts.final_norm.register_forward_hook(self._keep_h)
        model.register_forward_pre_hook(self._keep_inputs, with_kwargs=True)

    def _keep_h(self, module, args, out) -> None:
        self.h = out if torch.is_grad_enabled() else None

    def _keep_inputs(self, model, args, kwargs) -> None:
        self.positions = args[1] if len(args) > 1 else kwargs.get("positions")
        self.docs = kwargs.get("docs")

    def begin_step(self) -> None:
        self.total = None

    def padding(self, on: bool) -> None:
        """`on`: the passes that follow are padding (loss × 0): their MTP loss is not reported."""
        self._padding = on

    def __call__(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        main = self.loss_fn(out, targets)
        h, self.h = self.h, None
        if h is None or not torch.is_grad_enabled():  # evaluation: the main loss alone
            return main
        with self.zloss.main_only() if self.zloss is not None else nullcontext():
            mtp = self.mtp_loss(h, targets)
        if not self._padding:
            self.total = mtp.detach() if self.total is None else self.total + mtp.detach()
        return main + (mtp - mtp.detach()) * self.weight

    def mtp_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The unweighted MTP loss (mean over depths) of this rank's tokens from the final norm's
        output `h` and this rank's next-token `targets` [B, S]."""
        parts, S = self.parts, targets.shape[1]
        full = self._whole(targets)
        cos, sin, mask = parts.positional(S, h.device, self.positions, docs=self.docs)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for k, module in enumerate(parts.modules, 1):
            ahead, keep, target, share = self._pick(S, full.shape[1], k, h.device)
            h = module(h, parts.embed(full[:, ahead]), cos, sin, mask)
            out = h if parts.head is None else parts.head(h)
            total = total + self.loss_fn(out[:, keep], full[:, target]) * share
        return total / self.depth

    def _whole(self, targets: torch.Tensor) -> torch.Tensor:
        """The whole sequences' targets [B, S·cp] (this rank's own without context parallelism)."""
        if self.cp is None:
            return targets
        full = all_gather_dim(targets.contiguous(), self.cp.comm, 1)
        return sequence_order(list(full.chunk(2 * self.cp.comm.size, 1)), 1) if self.cp.split.zigzag else full

    def _pick(self, S: int, n: int, k: int, device: torch.device) -> tuple:
        """Depth k's indices into the whole sequence of n tokens, for this rank's S positions: the token
        each position embeds, the positions with a target, their targets, and their share (module doc)."""
        key = (S, k)
        if key not in self._picks:
            pos = self.cp.split.positions(S) if self.cp is not None else torch.arange(S)
            keep = (pos < n - k).nonzero().flatten()
            share = keep.numel() * (n // S) / (n - k)
            self._picks[key] = ((pos + k - 1).clamp(max=n - 1).to(device), keep.to(device),
                                (pos[keep] + k).to(device), share)
        return self._picks[key]
