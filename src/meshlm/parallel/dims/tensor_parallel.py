"""Tensor (Megatron-style) and sequence parallelism, applied to a meta-device model from outside.

Attention is split by heads (wq, wk, wv by output rows, wo by input columns) and the SwiGLU FFN by its
hidden units (w1, w3 by rows, w2 by columns), so each block half needs one reduction forward and one
backward: a forward pre-hook enters the TP region on the half's input, a forward hook leaves it on
its output. The model code is untouched: it reads head counts from the (sliced) weight shapes, and
which modules are regions, linears and norms comes from the model plan (parallel/model_plans/llama.py).

Grouped-query attention with fewer kv heads than ranks replicates each kv head on `tp/n_kv`
consecutive ranks; their gradients are summed over those replicas in backward.

Sequence parallelism keeps the residual stream and the norms split along the sequence between the
halves: entering becomes an all-gather and leaving a reduce-scatter (same bytes as the all-reduce
they replace), and norm gains, which then see only part of the tokens, sum their gradients. The
entry's all-gather is fused into the region's column-parallel linears (Megatron's sequence-parallel
linear): backward saves the shard and gathers it again for the weight gradients, one all-gather more
per region entry in backward in exchange for d·(t-1)/t fewer saved elements per token.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed.comm import Comm
from ...distributed.functional import (copy_to, gather_linears, gather_seq, reduce_from, reduce_scatter_seq, sum_grad,
                                       sum_grad_over_replicas)
from ...core.layout import check_shape
from ...core.model_args import padded_vocab
from ...model.init import canonical_name
from ..placement import DimSplit
from ..swap import swap_in
from .vocab_parallel import VocabParallelEmbedding, VocabParallelLoss


class _SummedGain:
    """A norm whose rank sees only part of the data, its gain replicated: the gain's gradient is summed
    over the TP group. A residual-stream norm on a sequence shard (SP), or a q/k norm (Qwen3) on this
    rank's heads (any TP). Mixed into the model's own norm class (`sum_gain_grad`): the model plan says
    which modules are norms, and a norm's seam is its `gain()`."""
    tp_comm: Comm

    def gain(self) -> torch.Tensor:
        return sum_grad(self.weight, self.tp_comm)


@functools.cache
def _summed_gain_class(cls: type) -> type:
    return type(f"SummedGain{cls.__name__}", (_SummedGain, cls), {})


def sum_gain_grad(model: nn.Module, mod: nn.Module, comm: Comm) -> None:
    """Seat `mod` (any norm class with `gain()`) in `model` in its `_SummedGain` form over `comm`."""
    if isinstance(mod, _SummedGain):
        mod.tp_comm = comm
    else:
        swap_in(model, mod, _summed_gain_class(type(mod)), tp_comm=comm)


def linear_bias(mod: nn.Module) -> torch.Tensor | None:
    """The bias of a column-parallel linear (q/k/v biases), its gradient summed over kv replicas."""
    b = mod.bias
    return None if b is None else sum_grad_over_replicas(b, mod.tp_comm, mod.tp_rep)


class ReplicatedKVLinear(nn.Linear):
    """wk / wv holding one kv head shared by `tp_rep` ranks: gradients summed over those ranks."""
    tp_comm: Comm
    tp_rep: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, sum_grad_over_replicas(self.weight, self.tp_comm, self.tp_rep), linear_bias(self))


class _ColumnGroup:
    """The column-parallel linears of one region under SP. The first of them called runs all of
    them at once on the gathered input (`gather_linears`: only the sequence shard is saved, and
    backward gathers it again); the others hand back their share."""

    def __init__(self, model: nn.Module, linears: list[nn.Module], comm: Comm):
        self.comm = comm
        self.x: torch.Tensor | None = None
        self.outs: list = []
        self.linears = [swap_in(model, mod, GatheredLinear, tp_comm=comm, tp_rep=getattr(mod, "tp_rep", 1),
                                group=self, slot=slot) for slot, mod in enumerate(linears)]

    def output(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        if self.x is not x or self.outs[slot] is None:
            weights = [sum_grad_over_replicas(m.weight, self.comm, m.tp_rep) for m in self.linears]
            self.x, self.outs = x, list(gather_linears(x, self.comm, weights))
        out, self.outs[slot] = self.outs[slot], None
        if all(o is None for o in self.outs):
            self.x = None  # hold nothing past the region's forward
        return out


class GatheredLinear(ReplicatedKVLinear):
    """A column-parallel linear under SP that takes the sequence shard (see `_ColumnGroup`); extends
    ReplicatedKVLinear so that a replicated kv projection may take this form too (tp_rep = 1 otherwise)."""
    group: _ColumnGroup
    slot: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.output(x, self.slot)
        b = linear_bias(self)
        return out if b is None else out + b


class SumGradLinear(nn.Linear):
    """A linear replicated on every TP rank whose gradient each rank only sees part of (a MoE router
    inside a TP region: its outputs weight partial expert outputs): gradients summed over the group."""
    tp_comm: Comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, sum_grad(self.weight, self.tp_comm))


class RegionEntry:
    """A TP region's entry pre-hook (`enter`: copy_to, or SP's gather_seq). Under SP without the fused
    entry, `readers` names the column-parallel linears that alone read the region's input, and fp8 may
    replace `enter` by a float8 gather once they multiply in float8 (features/float8_comm.py)."""

    def __init__(self, enter, readers: tuple[str, ...] = ()):
        self.enter, self.readers = enter, readers

    def __call__(self, module, inputs):
        return (self.enter(inputs[0]),) + tuple(inputs[1:])


@dataclass
class TensorParallel:
    """What `parallelize` needs from TP beyond the module swaps and hooks: the loss. The slices
    themselves are recorded in the placement table (`DimSplit` along the sliced dimension, a replica
    index for kv heads held by several ranks and for everything TP does not split); `vocab` is the
    vocabulary rows' split recorded there, which the embedding and the loss read their ids from;
    `entries`: SP's hooked region entries whose input only their column-parallel linears read."""
    comm: Comm
    sp: bool
    vocab: DimSplit
    entries: list[RegionEntry] = field(default_factory=list)

    def make_loss_fn(self, zloss=None) -> VocabParallelLoss:
        """`zloss`: training.z_loss's features/z_loss.ZLoss, or None."""
        return VocabParallelLoss(self.comm, self.vocab, zloss)


def _split(table, fqn: str, dim: int, size: int, comm: Comm, rep: int = 1, padded: int | None = None) -> None:
    """Record that parameter `fqn` is cut along `dim` into tp/rep chunks, chunk i held by ranks
    i·rep … i·rep+rep-1 (kv heads replicated when there are fewer than ranks)."""
    name = canonical_name(fqn)
    t, r = comm.size, comm.rank
    table.update(name, lambda pl: pl.split(DimSplit(dim, size, padded or size, t // rep, r // rep, comm.name)))
    if rep > 1:
        table.update(name, lambda pl: pl.replicate(comm.name, r % rep))


def apply_tensor_parallel(model: nn.Module, comm: Comm, sp: bool, plan, table, cp_split=None,
                          fuse_entry: bool = True) -> TensorParallel:
    """Module swaps, hooks and placement records on a meta-device model (activation checkpointing may
    already wrap its blocks). `plan` names the regions, linears and norms (parallel/model_plans/llama.py);
    `cp_split`: context parallelism's split, composed into SP's positions hook. `fuse_entry` = False
    keeps the blocks' column-parallel linears plain nn.Linear under SP (a hook gathers the region's
    input instead), so fp8 can convert them (parallel/features/float8.py)."""
    args, t = model.args, comm.size
    check_shape(args, t, 1, 1)  # layout.build_layout reports these before workers start
    tp = TensorParallel(comm=comm, sp=sp, vocab=_vocab_rows(model, comm, plan, table))
    leave = (lambda x: reduce_scatter_seq(x, comm)) if sp else (lambda x: reduce_from(x, comm))
    kv_rep = max(1, t // args.n_kv_heads)

    enter = (lambda x: gather_seq(x, comm)) if sp else (lambda x: copy_to(x, comm))

    def enter_hook(module, inputs):  # with SP, regions whose linears read the input fuse it (_ColumnGroup)
        return (enter(inputs[0]),) + tuple(inputs[1:])

    def leave_hook(module, inputs, output):
        return leave(output)

    split, seated = set(), {}
    for region in plan.tp_regions(model):
        for lin in region.linears:
            if lin.style == "full":  # replicated; each rank's gradient is its heads' part
                swap_in(model, lin.module, SumGradLinear, tp_comm=comm)
                continue
            rep = kv_rep if lin.kv else 1
            name = f"{lin.fqn}.{lin.param}"
            nd = len(table[canonical_name(name)].full_shape)  # stacked expert weights: [E, out, in]
            _split(table, name, nd - 2 if lin.style == "rows" else nd - 1, lin.size, comm, rep)
            split.add(canonical_name(name))
            if lin.param == "weight" and lin.module.bias is not None:  # q/k/v biases: split with their rows
                if lin.style != "rows":
                    raise ValueError(f"{lin.fqn}: a bias on a row-parallel linear is not supported")
                _split(table, f"{lin.fqn}.bias", 0, lin.size, comm, rep)
                split.add(canonical_name(f"{lin.fqn}.bias"))
            if rep > 1:
                seated[lin.fqn] = swap_in(model, lin.module, ReplicatedKVLinear, tp_comm=comm, tp_rep=rep)
        if sp and region.fused_entry and fuse_entry:  # the entry's all-gather is fused into the column-parallel linears
            _ColumnGroup(model, [seated.get(lin.fqn, lin.module) for lin in region.linears if lin.style == "rows"],
                         comm)
        elif sp and region.fused_entry:  # only its column-parallel linears read the input
            tp.entries.append(RegionEntry(enter, tuple(lin.fqn for lin in region.linears if lin.style == "rows")))
            region.module.register_forward_pre_hook(tp.entries[-1])
        else:
            region.module.register_forward_pre_hook(enter_hook)
        region.module.register_forward_hook(leave_hook)
    for mod in plan.norms(model) if sp else []:
        sum_gain_grad(model, mod, comm)
    for mod in plan.stream_linears(model) if sp else []:  # replicated, on this rank's tokens
        swap_in(model, mod, SumGradLinear, tp_comm=comm)
    for mod in plan.head_norms(model):  # replicated over tp (never split): gradients summed
        sum_gain_grad(model, mod, comm)
    plan.tp_extra(model, comm)
    split |= {n for n in plan.vocab_params() if n in table}
    _vocab_parallel(model, tp, plan, enter_hook)
    for name in table.names():  # everything else is a copy on every TP rank
        if name not in split:
            table.update(name, lambda pl: pl.replicate(comm.name, comm.rank))
    if sp:
        model.register_forward_pre_hook(positions_hook(t, plan, cp_split), with_kwargs=True)
    return tp


def pad_vocab(model: nn.Module, comm: Comm, plan, table) -> TensorParallel | None:
    """tp = 1: pad the embedding and head rows to `padded_vocab` with zeros (the vocab-parallel split with
    one chunk), or None when the vocabulary already is a multiple. The loss must cut the padded logits."""
    args = model.args
    if padded_vocab(args.vocab_size, args.vocab_multiple, comm.size) == args.vocab_size:
        return None
    return TensorParallel(comm=comm, sp=False, vocab=_vocab_rows(model, comm, plan, table))


def _vocab_rows(model: nn.Module, comm: Comm, plan, table) -> DimSplit:
    """Record the row split of the embedding and the head (tied: one parameter, split once), whichever
    this pipeline stage holds, and return it (a stage holding neither still gets it: its loss reads it)."""
    args = model.args
    v = args.vocab_size
    split = DimSplit(0, v, padded_vocab(v, args.vocab_multiple, comm.size), comm.size, comm.rank, comm.name)
    for name in plan.vocab_params():
        if name in table:
            table.update(name, lambda pl: pl.split(split))
    return split


def _vocab_parallel(model: nn.Module, tp: TensorParallel, plan, enter_hook) -> None:
    comm = tp.comm
    emb, head = plan.embedding(model), plan.head(model)
    if emb is not None:
        plan.set_embedding(model, VocabParallelEmbedding(emb.weight, comm, tp.vocab.start, tp.sp))
    if head is not None:
        # under training.loss_chunks the loss calls the head (features/chunked_loss.LossHead), which
        # chunks tokens: it takes them gathered
        if tp.sp and not model.head_in_loss:
            _ColumnGroup(model, [head], comm)
        else:
            head.register_forward_pre_hook(enter_hook)


def positions_hook(tp: int, plan, cp_split=None):
    """Pass the true positions of this rank's tokens to the model (unless given). Under SP the
    embedding output (or a pipeline stage's hidden input) is split along the sequence, so the model
    would size RoPE by the shard: the local sequence is tp shards long. Under CP (`cp_split`) the
    local sequence holds this rank's chunks of the full one, at their positions in it."""
    def hook(model, args, kwargs):
        given = args[1] if len(args) > 1 else kwargs.get("positions")
        if given is None:
            x = args[0]
            seq = x.shape[1] * (tp if x.is_floating_point() else 1)  # hidden states come as SP shards
            if cp_split is None:
                positions = torch.arange(seq, device=x.device)
            else:
                positions = cp_split.positions(seq, x.device)
                plan.reserve_positions(model, seq * cp_split.size, x.device)
            if len(args) > 1:
                args = (x, positions) + tuple(args[2:])
            else:
                kwargs = dict(kwargs, positions=positions)
        return args, kwargs
    return hook
