"""The held-out loss: `training.eval_batches` micro-batches of the validation split, each split over the
data-parallel ranks like a training batch and run by the step runner's `eval_loss`."""
from __future__ import annotations

import torch

from ..data.sampler import Batch
from ..parallel.step import local_batch


@torch.no_grad()
def evaluate(runner, local_tokens, data, ctx, layout, n_batches: int) -> float:
    """The mean token loss over the evaluation batches, the same on every rank (every micro-batch and
    context-parallel share has the same token count). `local_tokens`: this rank's part of full
    sequences (`Parallelized.local_tokens`)."""
    dp, r = layout.dp, ctx.index("dp")
    total, count = 0.0, 0
    for batch in data.eval_batches(layout.micro_batch * dp, n_batches):
        n = batch.inputs.shape[0] // dp
        if n:
            mine = local_batch(Batch(*(None if t is None else t[r * n:(r + 1) * n] for t in batch)),
                               local_tokens, ctx.device)
            total += float(runner.eval_loss(mine)) * n
        count += batch.inputs.shape[0] - batch.inputs.shape[0] % dp
    total = ctx.comm("dp_cp").all_reduce_scalars([total])[0]
    total = ctx.comm("pp").all_reduce_scalars([total])[0]  # pp > 1: only the last stage's is not 0
    return total / max(count * layout.cp, 1)
