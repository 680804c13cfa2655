"""training.z_loss: z · mean(log² Z) over the tokens, Z the main head's softmax normaliser (PaLM §5,
OLMo), which keeps the logits from drifting to large magnitudes at scale.

log Z is the log-sum-exp every loss kernel already computes for its cross-entropy, over the real
vocabulary (padded rows excluded, as the loss excludes them): the plain loss from the whole logits
(`plain`), the vocab-parallel loss from the shards' max and sum of exponentials (no logits gathered),
the chunked loss chunk by chunk (no logits whole). The two kernels with their own backward add the
term's gradient 2·z·log Z·softmax / N to the logits' gradient; the plain one lets autograd do it.

What each returns stays the cross-entropy: metrics.jsonl `loss` keeps its meaning and compares with
runs without z-loss, and `z_loss` (z · mean log² Z, the term the gradient sees, as OLMo logs it) is
logged beside it from `total`. The MTP heads get none (`main_only`): Megatron and OLMo put z-loss on
the main LM head only. Evaluation (no grad) neither adds nor records it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch


class ZLoss:
    """The z-loss weight and this step's sum of the term over this rank's micro-batches (`total`, None
    before any; the metrics line averages it over the global batch like the loss)."""

    def __init__(self, weight: float):
        self.weight = weight
        self.total: torch.Tensor | None = None
        self._paused = self._padding = False

    def padding(self, on: bool) -> None:
        """`on`: the passes that follow are padding (parallel/step.py, loss × 0): no term, none recorded."""
        self._padding = on

    def begin_step(self) -> None:
        self.total = None

    @property
    def coef(self) -> float:
        """The weight the loss being built gets: 0 under `main_only` and without autograd (evaluation)."""
        return 0.0 if self._paused or self._padding or not torch.is_grad_enabled() else self.weight

    def record(self, mean_sq: torch.Tensor, coef: float) -> None:
        """A kernel computed mean log² Z of one micro-batch under weight `coef` (> 0)."""
        term = mean_sq.detach() * coef
        self.total = term if self.total is None else self.total + term

    @contextmanager
    def main_only(self) -> Iterator[None]:
        """Losses built inside (the MTP heads') get no z-loss."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def plain(self, parts: Callable) -> Callable:
        """The loss_fn over whole logits: `parts(out, targets) -> (cross-entropy, mean log² Z)` (compiled
        or not; recording happens here, outside it); the value is the cross-entropy exactly and the
        gradient is the cross-entropy's plus coef × mean log² Z's."""
        def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            ce, mean_sq = parts(out, targets)
            coef = self.coef
            if not coef:
                return ce
            self.record(mean_sq, coef)
            return ce + (mean_sq - mean_sq.detach()) * coef
        return loss_fn
