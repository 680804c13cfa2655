"""Apply parallel dimensions to a plain model from outside (module swaps, hooks, wrappers).

`parallelize` turns a meta-device model into this rank's part of the job and returns what the
trainer drives, built once and frozen: the model, the optimizer over its masters, the gradient
synchroniser, the step runner (parallel/step.py) and the placement record of every parameter. Each
dimension adds to the records as it is applied (placement.py); the model-specific questions (which
linears TP splits, what a ZeRO unit is, what AC wraps, what a pipeline stage keeps) go to the model
plan (model_plans/llama.py).
The optimizer class comes from the trainer (train/ sits above parallel/); it must accept
`(named_params, optim_cfg, device, group_key=)`, implement `adamw.Optimizer` (as ZeRO's optimizers do)
and expose `.params`, `.names`, `.groups` (the parameters of each flat master, `grad_sync.flat_groups`,
given the reductions as `group_key`) and `bind_grads` for the DP gradient buffers, one per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core.choices import TORCH_DTYPES, choose, param_dtype
from ..core.config import OptimConfig, ParallelConfig, TrainingConfig
from ..distributed.mesh import ParallelContext
from ..core.layout import Layout
from ..model.fp8_kernels import check_fp8_device
from ..model.init import canonical_name, init_source, materialize
from .compile_cache import key_inductor_cache
from .dims.context_parallel import ContextParallel, apply_context_parallel
from .dims.data_parallel import GradBuckets
from .dims.expert_parallel import MoEStats, apply_expert_parallel, dispatch_in_float8, share_tokens_over_cp
from .dims.grad_sync import GradSync, Reduction
from .dims.pipeline.build import pipeline_runner, split_model
from .dims.tensor_parallel import apply_tensor_parallel, pad_vocab
from .dims.zero import shard_model
from .features.activation_checkpoint import apply_ac
from .features.chunked_loss import chunked_loss, head_in_loss
from .features.float8 import convert_to_float8, take_weights_from, zero_float8
from .features.float8_comm import comm_in_use, gather_entries_in_float8
from .features.mtp import MTPLoss
from .features.z_loss import ZLoss
from .optim.adamw import Optimizer
from .optim.muon import MuonAdamW
from .optim.nvme import NvmeOptimizer
from .optim.zero_adamw import ZeroOptimizer
from .optim.zero_muon import ZeroMuon
from .placement import PlacementTable
from .model_plans.moe import model_plan_for
from .step import Accumulation, StepRunner

if TYPE_CHECKING:
    from .dims.pipeline.runtime import PipelineRuntime


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Mean token loss in fp32. `vocab`: the real vocabulary size; the logits of padded rows
    (model.vocab_multiple) are cut off before the softmax, so padding never changes the loss. Slicing
    before .float() copies nothing extra in eager mode and fuses under compile."""
    if vocab is not None:
        logits = logits[..., :vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def cross_entropy_and_z(logits: torch.Tensor, targets: torch.Tensor,
                        vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`cross_entropy` and mean log² Z over the same real-vocabulary logits (training.z_loss,
    features/z_loss.py)."""
    if vocab is not None:
        logits = logits[..., :vocab]
    flat = logits.flatten(0, 1).float()
    return F.cross_entropy(flat, targets.flatten()), flat.logsumexp(-1).square().mean()


@dataclass(frozen=True)
class Parallelized:
    """What the trainer drives.
    - `loss_fn(model_output, targets)`: the mean token loss (vocab-parallel under TP);
    - `runner`: one step's forward and backward over every micro-batch, and the eval loss
      (parallel/step.py): gradient accumulation, or the pipeline runtime (pp > 1), which is then
      also `pipeline` (its bubble metric and trace);
    - `placements`: one record per parameter this rank holds (single-process names): `to_local`,
      checkpoint pieces and which copy owns each element (placement.py).
    """
    model: nn.Module
    optimizer: Optimizer
    grads: GradSync
    placements: PlacementTable
    world: object  # Comm over this island's ranks (all of them at one island): the gradient norm sums each owner's squares over it
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    runner: StepRunner
    names: dict[int, str]  # id() of each parameter -> its placement's name
    pipeline: PipelineRuntime | None = None  # pp > 1: the runner
    moe: MoEStats | None = None  # MoE models: routing metrics and the aux-loss gradient scale
    cp: ContextParallel | None = None  # cp > 1: which tokens of each sequence this rank holds
    mtp: MTPLoss | None = None  # model.mtp_depth > 0: the loss with the MTP term, its step's sum
    zloss: ZLoss | None = None  # training.z_loss > 0: its weight and its step's sum (features/z_loss.py)
    state_writer: bool = True  # writes the model-state buffers to checkpoints (one copy per stage)

    def local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of full sequences [B, S] (its context-parallel chunks; all without CP)."""
        return x if self.cp is None else self.cp.take(x)

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full single-process tensor of parameter `name`."""
        return self.placements.to_local(name, full)

    def model_state(self) -> dict[str, torch.Tensor]:
        """Model state that is not a parameter (the MoE selection bias), by single-process name: whole
        on every rank holding its module (replicated over dp, cp, tp and ep), never seen by the
        optimizer; checkpoints keep it beside the masters (`master/NAME`), where --to-hf reads it."""
        out = {}
        for fqn, mod in self.model.named_modules():
            for name, buf in mod._buffers.items():
                if buf is not None and name not in mod._non_persistent_buffers_set:
                    out[canonical_name(f"{fqn}.{name}" if fqn else name)] = buf
        return out

    def norm_grads(self) -> list[torch.Tensor]:
        """The gradient pieces this rank counts in the global norm: each element once over the world."""
        return [g for p, g in self.grads.param_grads() if self.placements[self.names[id(p)]].owner and g.numel()]


def named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters once each (tied weights once), under their single-process names."""
    return [(canonical_name(n), p) for n, p in model.named_parameters()]


def reductions(ctx: ParallelContext, layout: Layout, zero: int, split_tied: set[str],
               expert: Callable[[str], bool] = lambda name: False) -> Callable[[str], Reduction]:
    """Every parameter's gradient reduction: averaged over the data-parallel and context-parallel ranks
    (each holds the same weights and other tokens: reduce-scattered over the ZeRO shard group
    dp_shard×cp and all-reduced over HSDP replicas, or all-reduced over dp×cp); a tied weight held by
    both pipeline ends (`split_tied`: its name, or empty) is also summed over the two. Under expert
    parallelism, expert weights (`expert(name)`) already hold every ep peer's tokens: summed over the
    ranks holding the same experts (`edp`; ZeRO: scattered over `edp_shard`, all-reduced over the HSDP
    replicas), divided by dp×cp too."""
    if zero:
        base = Reduction(ctx.comm("dp_shard_cp"), (ctx.comm("dp_replicate"),), (), layout.dp * layout.cp)
    else:
        base = Reduction(None, (ctx.comm("dp_cp"),), (), layout.dp * layout.cp)
    tied = Reduction(base.scatter, base.all_reduce_over, (ctx.comm("pp_ends"),), base.divisor)
    if not layout.ep_enabled:
        return lambda name: tied if name in split_tied else base
    experts = (Reduction(ctx.comm("edp_shard"), (ctx.comm("dp_replicate"),), (), base.divisor) if zero
               else Reduction(None, (ctx.comm("edp"),), (), base.divisor))
    return lambda name: experts if expert(name) else tied if name in split_tied else base


def slices(cfg) -> dict:
    """`parallelize`'s keyword arguments cut from a whole config: the one place that reads all of it."""
    return {"parallel": cfg.parallel, "training": cfg.training, "optim": cfg.optim, "init_from": cfg.model.init_from}


def parallelize(model: nn.Module, ctx: ParallelContext, layout: Layout, make_optimizer: Callable, *,
                parallel: ParallelConfig, training: TrainingConfig, optim: OptimConfig, init_from: str = "",
                plan=None) -> Parallelized:
    """`model` was built on the meta device; materialise and wrap it for this rank. Each dimension takes
    the config keys it reads: the parallel section, the training section's precision / AC / loss /
    compile knobs, the optimizer section; `init_from`: model.init_from ("hf:DIR" or empty)."""
    plan = plan or model_plan_for(model)
    if training.compile:
        key_inductor_cache()  # before the first compile: one kernel cache per CPU capability
    pipe = split_model(model, ctx, layout, plan, parallel) if layout.pp_enabled else None  # this rank's stages
    table = PlacementTable()
    for name, p in named_params(model):
        table.add(name, tuple(p.shape))
    experts = plan.expert_params(model)
    muon = plan.muon_params(model) & set(table.names()) if optim.name == "muon" else set()
    cp, tp, loss_head = _apply_dims(model, ctx, layout, plan, table, experts, parallel, training)
    split = {fqn: table[canonical_name(fqn)] for fqn, _ in model.named_parameters()
             if table[canonical_name(fqn)].splits}
    materialize(model, training.seed, ctx.device, dtype=torch_dtype(param_dtype(training.precision)),
                full_shapes={f: pl.full_shape for f, pl in split.items()},
                slicers={f: pl.to_local for f, pl in split.items()},
                source=init_source(init_from, model.args))  # model.init_from = "hf:DIR"
    fp8_comm = comm_in_use(training, layout)  # the collectives that move float8 (docs/fp8.md)
    if training.precision == "fp8":  # after TP and materialize: each linear holds its local shard
        check_fp8_device(training, model.args.moe)  # one line where this torch cannot (the entry asked first)
        convert_to_float8(model, plan, training.fp8_recipe, training.fp8_emulate, zero_cast="zero" in fp8_comm)
        if "sp" in fp8_comm:
            gather_entries_in_float8(model, tp)
        if "ep" in fp8_comm:
            dispatch_in_float8(model, plan)
    # op-level AC over a TP block: the region holds Comm's collectives, whose byte accounting dynamo will
    # not trace inside a checkpoint; such blocks stay eager (the policy then counts exactly what it keeps)
    if training.compile and not (training.ac == "op" and layout.tp_enabled):
        for key, block in list(plan.blocks(model).items()):
            plan.blocks(model)[key] = torch.compile(block, dynamic=False)
    named = named_params(model)
    split_tied = {plan.tied_name()} & set(table.names()) if pipe is not None and pipe.tied else set()
    reduction_of = reductions(ctx, layout, parallel.zero, split_tied, experts.__contains__)
    float8 = zero_float8(model) if "zero" in fp8_comm else None
    grads, opt = _synchroniser_and_optimizer(model, named, ctx, plan, table, parallel, optim, make_optimizer,
                                             reduction_of, bool(split_tied), muon, float8)
    if float8 is not None:
        take_weights_from(model, grads.float8_weight, grads.float8_expert_weight)
    for name in table.names():  # the copies a reduction sums are replicas of one another
        red = reduction_of(name)
        for c in red.all_reduce_over + red.sum_at_finish:
            if c.size > 1:
                table.update(name, lambda pl: pl.replicate(c.name, c.rank))
    zloss = ZLoss(training.z_loss) if training.z_loss > 0 else None
    loss_fn = _loss_fn(model, tp, loss_head, ctx, layout, training.compile, zloss)
    # model.mtp_depth: the MTP term joins the gradient (its hooks after SP's and CP's: features/mtp.py)
    mtp = MTPLoss(model, plan.mtp_parts(model), loss_fn, training.mtp_loss_weight, cp, zloss) if model.args.mtp_depth and \
        training.mtp_loss_weight > 0 else None
    loss_fn = mtp or loss_fn
    moe = MoEStats(model, plan, layout.tp) if model.args.moe else None
    counted = [c for c in (moe, mtp, zloss) if c is not None]  # told which passes pad (dp_weights)
    if pipe is not None:
        runner = pipeline_runner(model, grads, loss_fn, pipe, ctx, layout, plan, schedule=parallel.pp_schedule,
                                 sp=parallel.sp, split_w=training.ac not in ("full", "op"), counted=counted)
    else:
        # ZeRO-2/3 and EP meet other replicas on every micro-batch: uneven replicas pad to the longest
        runner = Accumulation(model, loss_fn, grads, layout.micro_batch, layout.accum_of(ctx.index("dp")),
                              layout.dp_pad_to, counted)
    return Parallelized(model=model, optimizer=opt, grads=grads, placements=table, world=ctx.comm("island"),
                        loss_fn=loss_fn, runner=runner, names={id(p): name for name, p in named},
                        pipeline=runner if pipe is not None else None,
                        moe=moe, cp=cp, mtp=mtp, zloss=zloss,
                        state_writer=all(i == 0 for d, i in ctx.coords.items() if d not in ("pp", "islands")))


def _apply_dims(model, ctx, layout, plan, table, experts, parallel: ParallelConfig, training: TrainingConfig):
    """EP, AC, the loss head, CP and TP on the meta model, in the order each expects the others:
    (the CP handle or None, the TP handle (tp = 1: the vocabulary padding) or None, the chunked loss head
    or None)."""
    if layout.ep_enabled:
        apply_expert_parallel(model, ctx.comm("ep"), plan, table, experts)
    if layout.cp_enabled and model.args.moe:
        share_tokens_over_cp(model, ctx.comm("cp"), plan)
    apply_ac(model, training.ac, plan)
    # training.loss_chunks: the head moves into the loss (before TP, which hooks the head it finds)
    loss_head = head_in_loss(model, plan, training.loss_chunks) if training.loss_chunks else None
    sp = layout.sp_enabled
    cp = (apply_context_parallel(model, ctx.comm("cp"), parallel.cp_impl, plan, sp,
                                 model.args.attn_kernel == "flex") if layout.cp_enabled else None)
    # tp > 1: every tensor-parallel split (vocab-parallel, padded); tp = 1: only the vocabulary padding, if any
    tp = (apply_tensor_parallel(model, ctx.comm("tp"), parallel.sp, plan, table, cp and cp.split,
                                fuse_entry=training.precision != "fp8")
          if layout.tp_enabled else pad_vocab(model, ctx.comm("tp"), plan, table))
    return cp, tp, loss_head


def _synchroniser_and_optimizer(model, named, ctx, plan, table, parallel: ParallelConfig, optim: OptimConfig,
                                make_optimizer, reduction_of, split_tied: bool, muon: set, float8=None):
    """The gradient synchroniser (ZeRO units or DP buckets) and the optimizer over what it holds; `float8`:
    the weights zero 3 gathers in float8 (features/float8.py `zero_float8`) or None."""
    reduce_dtype = torch_dtype(parallel.reduce_dtype)
    bucket = int(parallel.bucket_mb * 2 ** 20)
    if parallel.zero:  # ZeRO-1/2/3, HSDP
        grads = shard_model(model, named, parallel, plan, split_tied, reduction_of, reduce_dtype, ctx, float8)
        if parallel.offload == "nvme":
            opt = NvmeOptimizer(grads, optim, parallel.offload_dir, parallel.offload_buffer_mb, ctx.rank)
        else:
            opt = ZeroOptimizer(grads, optim, parallel.offload == "optimizer", frozenset(muon))
            if muon:
                opt = MuonAdamW(opt, ZeroMuon(opt, muon, table, ctx.comm, optim), optim)
        for u in grads.units:  # ZeRO's ranges, computed once by the unit (zero/units.py `Segment`)
            for seg, name in zip(u.pieces, u.names):
                table.update(name, lambda pl: pl.shard_flat(seg.param_start, seg.param_end, u.comm.name))
        return grads, opt
    key = lambda n: reduction_of(n).key  # noqa: E731
    opt = (MuonAdamW.local(named, optim, ctx.device, make_optimizer, muon, table, ctx.comm, key, bucket) if muon
           else make_optimizer(named, optim, ctx.device, group_key=key))
    grads = GradBuckets(opt.params, [reduction_of(n) for n in opt.names], bucket, reduce_dtype, opt.groups)
    opt.bind_grads(grads.flat)
    return grads, opt


def _loss_fn(model, tp, loss_head, ctx, layout, compile_: bool, zloss: ZLoss | None = None):
    """The mean token loss: vocab-parallel under TP, chunked with a loss head, else cross-entropy over the
    real vocabulary (compiled when the blocks are: it fuses well, and has no collective inside).
    `zloss`: training.z_loss, which each of them computes from its own log-sum-exp."""
    if loss_head is not None:
        return chunked_loss(loss_head, tp and tp.vocab, ctx.comm("tp") if layout.tp_enabled else None, compile_,
                            zloss)
    if layout.tp_enabled:
        return tp.make_loss_fn(zloss)
    # drops padded logits, if any
    loss_fn = partial(cross_entropy_and_z if zloss else cross_entropy, vocab=model.args.vocab_size)
    if compile_:
        loss_fn = torch.compile(loss_fn, dynamic=False)
    return zloss.plain(loss_fn) if zloss else loss_fn


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, TORCH_DTYPES[choose(name, tuple(TORCH_DTYPES), "dtype")])
