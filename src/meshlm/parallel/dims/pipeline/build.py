"""Cut the model into this rank's pipeline stages, and build the executor that runs them.

`split_model` runs first, on the meta-device model: it keeps only the blocks of this rank's chunks
(global keys, so parameter names stay the single-process names), the embedding on the rank holding
stage 0 and norm + head on the rank holding the last stage. Every other piece of `parallelize`
(activation checkpointing, TP, materialisation, compile, ZeRO, the optimizer) then applies to that
one pruned model unchanged. `pipeline_runner` builds a `Stage` view per chunk and the runtime: the
step runner (parallel/step.py) of a pipelined `Parallelized`.

Tied embeddings, or MTP modules (which sit on the last stage and embed the tokens ahead): the last
stage keeps the embedding's weight too (the plan's `prune`); the two copies are summed over the
pipeline ends like any other gradient reduction (their `Reduction.sum_at_finish`). Under ZB-V rank 0
holds both ends, so the weight is one parameter there and nothing is summed.
"""
from __future__ import annotations

from torch import nn

from ....core.schedule.actions import stage_owner
from ....core.schedule.check import check_schedule
from ....core.schedule.schedules import V_SHAPED, build_schedule
from ....core.schedule.stage import PipelineStages, stage_blocks


def split_model(model: nn.Module, ctx, layout, plan, parallel) -> PipelineStages:
    """Prune the meta-device `model` to this rank's stages (in place; what to keep is the model
    plan's call, parallel/model_plans/llama.py)."""
    args = model.args
    vshape = parallel.pp_schedule in V_SHAPED
    S = layout.pp * parallel.pp_virtual
    # the tied weight is split over two ranks unless one rank holds both ends (ZB-V's rank 0)
    split_tied = stage_owner(0, layout.pp, vshape)[0] != stage_owner(S - 1, layout.pp, vshape)[0]
    pipe = PipelineStages(stage_blocks(args, parallel, layout.microbatches), ctx.index("pp"), layout.pp,
                        parallel.pp_virtual, plan.embedding_at_head(model) and split_tied, vshape)
    keep = {str(i) for c in range(pipe.v) for i in pipe.blocks[pipe.stage(c)]}
    plan.prune(model, keep, pipe.holds(0), pipe.holds(S - 1))
    return pipe


def pipeline_runner(model: nn.Module, grads, loss_fn, pipe: PipelineStages, ctx, layout, plan, *, schedule: str,
                    sp: bool, split_w: bool, counted=()):
    """The runtime over this rank's chunks of the pruned, materialised `model`. `split_w`: the zero-bubble
    I/W split of a block's backward (off under block AC, which recomputes per call: backward.py).
    parallel.dp_weights: the schedule is built for this replica's own count (every stage of a replica
    shares it), padded to the longest where collectives span replicas per micro-batch (`Layout.dp_pad_to`;
    `counted`: what the padding must not count in, as parallel/step.py `Accumulation`)."""
    from .runtime import PipelineRuntime, Stage

    p, v = pipe.p, pipe.v
    S = p * v
    stages = [Stage(model, plan, [str(i) for i in pipe.blocks[pipe.stage(c)]], pipe.stage(c),
                    pipe.stage(c) == 0, pipe.stage(c) == S - 1) for c in range(v)]

    def schedule_for(m: int):
        """The checked action lists of a step of m micro-batches (training.batch_rampup: several m)."""
        actions = build_schedule(schedule, p, m, v)
        check_schedule(actions, p, m, v, pipe.vshape)
        return actions

    args = model.args
    split = layout.tp if sp and layout.tp_enabled else 1

    def act_shape(n: int, seq: int) -> tuple[int, int, int]:
        return (n, seq // split, args.dim)

    dtype = next(model.parameters()).dtype
    return PipelineRuntime(stages, schedule_for, pipe.rank, ctx.comm("pp"), grads, loss_fn, dtype, ctx.device,
                           act_shape, layout.micro_batch, layout.accum_of(ctx.index("dp")), schedule,
                           split_w=split_w, vshape=pipe.vshape, pad_to=layout.dp_pad_to, counted=counted)
