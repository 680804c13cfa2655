"""Multi-token prediction loss (DeepSeek-V3 §2.2) for one process: the model's MTP modules
(llama.MTPModule, model.mtp_depth = D) run after the main forward.

Depth k (1 … D) at position i combines the previous depth's representation there (depth 0: the main
model's final norm output) with the embedding of token i + k, and predicts token i + k + 1 through
the shared head; only positions i < S − k have such a target. The loss is
    training.mtp_loss_weight / D · Σ_k loss_fn(outputs of depth k at i < S − k, targets[:, k:])
with `loss_fn` the trainer's own loss (mean over its tokens). The tokens ahead come from `targets`
(targets[:, i] = token i + 1); positions past the end embed the last target again, and causal
attention keeps them from every position that has a target.

How the trainer adds it (the main loss is unchanged):
    model.head_in_loss = True              # forward returns the final norm's output h [B, S, dim]
    h = model(tokens, docs=docs)
    out = h if <its loss applies the head (training.loss_chunks)> else model.output(h)
    loss = loss_fn(out, targets) + mtp_loss(model, h, targets, cfg.training.mtp_loss_weight, loss_fn, docs)
(`mtp_loss` hands loss_fn the head's logits, or the MTP representation itself when
model.head_in_loss and the loss applies the head, the same contract as the main loss.) The MTP
modules' MoE blocks route and record statistics like any other block (their auxiliary losses reach
the router the same way). Positions are this process's whole sequences: under context parallelism
the tokens ahead of a rank's last positions live on another rank, which this function does not fetch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean token loss in fp32 over the real vocabulary (padded head rows cut off)."""
    return F.cross_entropy(logits[..., :vocab].flatten(0, 1).float(), targets.flatten())


def ahead(targets: torch.Tensor, j: int) -> torch.Tensor:
    """targets shifted left by j (token i + j + 1 at position i), the last target repeated to keep S."""
    return targets if j == 0 else torch.cat([targets[:, j:], targets[:, -1:].expand(-1, j)], 1)


def mtp_loss(model, h: torch.Tensor, targets: torch.Tensor, weight: float, loss_fn=None,
             docs: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted MTP loss of `model` (module doc) from the main model's final norm output `h`
    [B, S, dim] and the next-token `targets` [B, S]; 0 without MTP modules. `loss_fn(output, targets)`:
    default the mean cross-entropy of the head's logits."""
    depth = len(model.mtp) if model.mtp is not None else 0
    if depth == 0 or weight == 0:
        return h.new_zeros((), dtype=torch.float32)
    S = targets.shape[1]
    if S <= depth:
        raise ValueError(f"mtp: sequences of {S} tokens leave no target {depth + 1} tokens ahead")
    head_in_loss = model.head_in_loss and loss_fn is not None  # the default loss takes logits
    if loss_fn is None:
        def loss_fn(logits, t):
            return cross_entropy(logits, t, model.args.vocab_size)
    cos, sin, mask = model.positional(S, h.device, positions, docs=docs)
    total = h.new_zeros((), dtype=torch.float32)
    for k, module in enumerate(model.mtp.values(), 1):
        h = module(h, model.tok_embeddings(ahead(targets, k - 1)), cos, sin, mask)
        out = h if head_in_loss else model.output(h)
        total = total + loss_fn(out[:, :S - k], targets[:, k:])
    return total * (weight / depth)
