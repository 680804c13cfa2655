"""Cut the model into this rank's pipeline stages, and hook the executor into `Parallelized`.

`split_model` runs first, on the meta-device model: it keeps only the blocks of this rank's chunks
(global keys, so parameter names stay the single-process names), the embedding on the rank holding
stage 0 and norm + head on the rank holding the last stage. Every other piece of `parallelize`
(activation checkpointing, TP, materialisation, compile, ZeRO, the optimizer) then applies to that
one pruned model unchanged. `attach` builds a `Stage` view per chunk and the runtime.

Tied embeddings: the last stage keeps the embedding module too, only as the holder of the shared
weight (its forward never runs there), so the copy has the single-process name and initial value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .actions import stage_index
from .check import check_schedule
from .schedules import V_SHAPED, build_schedule
from .stage import check_pipeline, estimate_costs


@dataclass
class PipelinePlan:
    blocks: list[list[int]]  # global block indices of every stage
    rank: int
    p: int
    v: int
    tied: bool
    vshape: bool = False

    def stage(self, chunk: int) -> int:
        return stage_index(self.rank, chunk, self.p, self.vshape)

    def holds(self, stage: int) -> bool:
        return any(self.stage(c) == stage for c in range(self.v))


def plan_stages(args, cfg, m: int) -> list[list[int]]:
    p = cfg.parallel
    costs = estimate_costs(args.dim, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size)
    return check_pipeline(args.n_layers, p.pp, p.pp_virtual, p.pp_schedule, m, list(p.pp_layers), costs)


def split_model(model: nn.Module, ctx, cfg, layout) -> PipelinePlan:
    """Prune the meta-device `model` to this rank's stages (in place)."""
    args = model.args
    plan = PipelinePlan(plan_stages(args, cfg, layout.microbatches), ctx.index("pp"), layout.pp,
                        cfg.parallel.pp_virtual, bool(args.tie_embeddings),
                        cfg.parallel.pp_schedule in V_SHAPED)
    keep = {str(i) for c in range(plan.v) for i in plan.blocks[plan.stage(c)]}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    first, last = plan.holds(0), plan.holds(plan.p * plan.v - 1)
    if not (first or (last and plan.tied)):
        model.tok_embeddings = None
    if not last:
        model.norm, model.output = None, None
    return plan


def attach(par, plan: PipelinePlan, ctx, cfg, layout) -> None:
    """Give `par` the pipeline step: forward_backward, eval_loss and the runtime (for traces)."""
    from .runtime import PipelineRuntime, Stage

    model, p, v = par.model, plan.p, plan.v
    S = p * v
    stages = [Stage(model, [str(i) for i in plan.blocks[plan.stage(c)]], plan.stage(c),
                    plan.stage(c) == 0, plan.stage(c) == S - 1) for c in range(v)]
    m = layout.microbatches
    actions = build_schedule(cfg.parallel.pp_schedule, p, m, v)
    check_schedule(actions, p, m, v, plan.vshape)
    tied = None
    first, last = plan.holds(0), plan.holds(S - 1)
    if plan.tied and first != last:  # one rank holding both (ZB-V's rank 0) has one shared weight
        tied = (model.tok_embeddings if first else model.output).weight
    args = model.args
    split = layout.tp if cfg.parallel.sp and layout.tp > 1 else 1

    def act_shape(n: int, seq: int) -> tuple[int, int, int]:
        return (n, seq // split, args.dim)

    dtype = next(model.parameters()).dtype
    rt = PipelineRuntime(stages, actions, plan.rank, ctx.comm("pp"), par.grads, par.loss_fn, dtype,
                         ctx.device, act_shape, m, tied, cfg.parallel.pp_schedule,
                         split_w=cfg.training.ac != "full",  # backward.py: full AC recomputes per call
                         vshape=plan.vshape)
    par.forward_backward, par.eval_loss, par.pipeline = rt.forward_backward, rt.eval_loss, rt
    _norm_over_pp(par.grads, model, ctx.comm("pp"), tied if last else None)


def _norm_over_pp(grads, model: nn.Module, pp, duplicate: torch.Tensor | None) -> None:
    """The gradient norm sums over the pp group too; the last stage's tied copy is not counted."""
    by_id = {id(q): q for q in model.parameters()}
    dup = id(duplicate) if duplicate is not None else None
    if grads.norm_groups is None:
        groups = [([q for i, q in by_id.items() if i != dup], [pp])]
    else:
        groups = [([by_id[i] for i in ids if i != dup], list(comms) + [pp]) for ids, comms in grads.norm_groups]
    grads.set_norm_groups(groups)
