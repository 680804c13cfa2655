"""Tensor (Megatron-style) and sequence parallelism, applied to a meta-device Llama from outside.

Attention is split by heads (wq, wk, wv by output rows, wo by input columns) and the SwiGLU FFN by its
hidden units (w1, w3 by rows, w2 by columns), so each block half needs one reduction forward and one
backward: a forward pre-hook enters the TP region on the half's input, a forward hook leaves it on
its output. The model code is untouched: it reads head counts from the (sliced) weight shapes.

Grouped-query attention with fewer kv heads than ranks replicates each kv head on `tp/n_kv`
consecutive ranks; their gradients are summed over those replicas in backward.

Sequence parallelism keeps the residual stream and the norms split along the sequence between the
halves: entering becomes an all-gather and leaving a reduce-scatter (same bytes as the all-reduce
they replace), and norm gains, which then see only part of the tokens, sum their gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.comm import Comm
from ..distributed.functional import (all_gather_dim, copy_to, gather_seq, reduce_from, reduce_scatter_seq,
                                      sum_grad, sum_grad_over_replicas)
from ..layout import check_shape
from ..model.args import padded_vocab
from ..model.init import Slicer, canonical_name
from ..model.llama import Attention, FeedForward, Llama, RMSNorm
from .vocab_parallel import VocabParallelEmbedding, VocabParallelLoss, vocab_range


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is cut: along `dim`, whose single-process size `size` is padded to `padded`,
    into tp/rep chunks, chunk i held by ranks i·rep … i·rep+rep-1."""
    dim: int
    size: int
    padded: int
    rep: int = 1

    @torch.no_grad()
    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        if self.padded > self.size:
            pad = list(full.shape)
            pad[self.dim] = self.padded - self.size
            full = torch.cat([full, full.new_zeros(pad)], dim=self.dim)
        chunk = self.padded // (tp // self.rep)
        return full.narrow(self.dim, (rank // self.rep) * chunk, chunk).contiguous()

    @torch.no_grad()
    def gather(self, local: torch.Tensor, comm: Comm) -> torch.Tensor:
        full = all_gather_dim(local.detach(), comm, self.dim)
        if self.rep > 1:  # keep one copy of each replicated chunk
            full = torch.cat(full.split(local.shape[self.dim], dim=self.dim)[::self.rep], dim=self.dim)
        return full.narrow(self.dim, 0, self.size).contiguous()


class SeqParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard: its gain's gradient is summed over the TP group."""
    tp_comm: Comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # RMSNorm.forward with the gain wrapped
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * sum_grad(self.weight, self.tp_comm)


class ReplicatedKVLinear(nn.Linear):
    """wk / wv holding one kv head shared by `tp_rep` ranks: gradients summed over those ranks."""
    tp_comm: Comm
    tp_rep: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, sum_grad_over_replicas(self.weight, self.tp_comm, self.tp_rep))


@dataclass
class TensorParallel:
    """What `parallelize` needs from TP: materialize inputs, the loss, checkpoint mapping, norm groups.
    At tp = 1 (`pad_vocab`) it only pads the vocabulary rows: the same specs, nothing to gather."""
    comm: Comm
    sp: bool
    vocab_size: int
    vocab_multiple: int = 1
    specs: dict[str, ShardSpec] = field(default_factory=dict)  # by single-process name
    full_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # by module path
    slicers: dict[str, Slicer] = field(default_factory=dict)  # by module path

    def shard(self, fqn: str, param: nn.Parameter, spec: ShardSpec) -> None:
        self.specs[canonical_name(fqn)] = spec
        self.full_shapes[fqn] = tuple(param.shape)
        rank, tp = self.comm.rank, self.comm.size
        self.slicers[fqn] = lambda full: spec.local(full, rank, tp)

    def make_loss_fn(self) -> VocabParallelLoss:
        return VocabParallelLoss(self.comm, self.vocab_size, self.vocab_multiple)

    def to_full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        spec = self.specs.get(name)
        return t if spec is None else spec.gather(t, self.comm)

    def to_local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        spec = self.specs.get(name)
        return t if spec is None else spec.local(t, self.comm.rank, self.comm.size)

    def norm_groups(self, named: list[tuple[str, nn.Parameter]]) -> list[tuple[list[nn.Parameter], list[Comm]]]:
        """Sharded parameters count their squares over the group, replicated ones once; a kv head
        replicated on several ranks is counted by the first of them only."""
        sharded, replicated = [], []
        for name, p in named:
            spec = self.specs.get(name)
            if spec is None:
                replicated.append(p)
            elif self.comm.rank % spec.rep == 0:
                sharded.append(p)
        return [(sharded, [self.comm]), (replicated, [])]


def apply_tensor_parallel(model: Llama, comm: Comm, sp: bool) -> TensorParallel:
    """Slice plan + hooks + module swaps on a meta-device model (activation checkpointing may already
    wrap its blocks). Returns what materialize and parallelize need."""
    args, t = model.args, comm.size
    check_shape(args, t, 1, 1)  # layout.resolve reports these before workers start
    plan = TensorParallel(comm=comm, sp=sp, vocab_size=args.vocab_size, vocab_multiple=args.vocab_multiple)
    enter = (lambda x: gather_seq(x, comm)) if sp else (lambda x: copy_to(x, comm))
    leave = (lambda x: reduce_scatter_seq(x, comm)) if sp else (lambda x: reduce_from(x, comm))
    hd = args.head_dim
    kv_rep = max(1, t // args.n_kv_heads)

    def enter_hook(module, inputs):
        return (enter(inputs[0]),) + tuple(inputs[1:])

    def leave_hook(module, inputs, output):
        return leave(output)

    def rows(fqn: str, lin: nn.Linear, size: int, rep: int = 1) -> None:
        plan.shard(f"{fqn}.weight", lin.weight, ShardSpec(0, size, size, rep))

    def cols(fqn: str, lin: nn.Linear, size: int) -> None:
        plan.shard(f"{fqn}.weight", lin.weight, ShardSpec(1, size, size))

    for fqn, mod in list(model.named_modules()):
        if isinstance(mod, Attention):
            rows(f"{fqn}.wq", mod.wq, args.n_heads * hd)
            for name in ("wk", "wv"):
                lin = getattr(mod, name)
                rows(f"{fqn}.{name}", lin, args.n_kv_heads * hd, kv_rep)
                if kv_rep > 1:
                    lin.__class__ = ReplicatedKVLinear
                    lin.tp_comm, lin.tp_rep = comm, kv_rep
            cols(f"{fqn}.wo", mod.wo, args.n_heads * hd)
        elif isinstance(mod, FeedForward):
            rows(f"{fqn}.w1", mod.w1, args.ffn_dim)
            rows(f"{fqn}.w3", mod.w3, args.ffn_dim)
            cols(f"{fqn}.w2", mod.w2, args.ffn_dim)
        else:
            continue
        mod.register_forward_pre_hook(enter_hook)
        mod.register_forward_hook(leave_hook)
    if sp:
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.__class__ = SeqParallelRMSNorm
                mod.tp_comm = comm
    _vocab_parallel(model, plan, enter_hook)
    if sp:
        model.register_forward_pre_hook(_positions_hook(t), with_kwargs=True)
    return plan


def pad_vocab(model: Llama, comm: Comm) -> TensorParallel | None:
    """tp = 1: pad the embedding and head rows to `padded_vocab` with zeros (the vocab-parallel split with
    one chunk), or None when the vocabulary already is a multiple. The loss must cut the padded logits."""
    args = model.args
    if padded_vocab(args.vocab_size, args.vocab_multiple, comm.size) == args.vocab_size:
        return None
    plan = TensorParallel(comm=comm, sp=False, vocab_size=args.vocab_size, vocab_multiple=args.vocab_multiple)
    _vocab_rows(model, plan)
    return plan


def _vocab_rows(model: Llama, plan: TensorParallel) -> None:
    """Row specs of the embedding and the head (tied: one parameter, sliced once), whichever this
    pipeline stage holds."""
    v = model.args.vocab_size
    spec = ShardSpec(0, v, padded_vocab(v, plan.vocab_multiple, plan.comm.size))
    emb, out = model.tok_embeddings, model.output
    if emb is not None:
        plan.shard("tok_embeddings.weight", emb.weight, spec)
    if out is not None:
        if emb is not None and out.weight is emb.weight:
            plan.specs["output.weight"] = spec
        else:
            plan.shard("output.weight", out.weight, spec)


def _vocab_parallel(model: Llama, plan: TensorParallel, enter_hook) -> None:
    comm = plan.comm
    _vocab_rows(model, plan)
    if model.tok_embeddings is not None:
        start = vocab_range(model.args.vocab_size, comm.size, comm.rank, plan.vocab_multiple)[0]
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, comm, start, plan.sp)
    if model.output is not None:
        model.output.register_forward_pre_hook(enter_hook)


def _positions_hook(tp: int):
    """Under SP the embedding output is already split along the sequence, so the model would size
    RoPE by the local length: pass the full sequence's positions instead (unless given)."""
    def hook(model, args, kwargs):
        given = args[1] if len(args) > 1 else kwargs.get("positions")
        if given is None:
            x = args[0]
            seq = x.shape[1] * (tp if model.tok_embeddings is None else 1)  # a stage gets hidden shards
            positions = torch.arange(seq, device=x.device)
            if len(args) > 1:
                args = (x, positions) + tuple(args[2:])
            else:
                kwargs = dict(kwargs, positions=positions)
        return args, kwargs
    return hook


# ---------------------------------------------------------------------------------- accounting

def expected_bytes(args, micro_batch: int, seq_len: int, accum: int, tp: int, sp: bool, ac: str = "none",
                   act_bytes: int = 4, param_bytes: int = 4) -> dict[str, tuple[int, int]]:
    """{collective kind: (calls, bytes)} the TP group runs per optimizer step, counted the way `Comm`
    books them (all-reduce 2× its buffer, all-gather its output, reduce-scatter its input).

    Per micro-batch: each block half reduces once forward and once backward (full AC recomputes the
    forward: see below); the embedding reduces forward, the head's input backward. The loss adds a max and a
    (sum-exp, target-logit) all-reduce of [tokens] fp32; SP adds one gain-gradient all-reduce per
    norm, kv replicas one per wk/wv. The grad-norm all-reduce is one fp32 scalar per step."""
    if tp == 1:
        return {}
    sp = sp and tp > 1
    tokens, layers = micro_batch * seq_len, args.n_layers
    act = act_bytes * tokens * args.dim
    # Entering a TP region: 2 block halves per layer + the head; leaving: 2 per layer + the embedding.
    # Full AC recomputes each block in backward, entering both halves again but leaving only the
    # attention half: torch's checkpoint stops once the last saved tensor (w2's input) is rebuilt.
    regions = 2 * layers + 1
    again_in, again_out = (2 * layers, layers) if ac == "full" else (0, 0)
    calls: dict[str, list[int]] = {}

    def add(kind: str, n: int, nbytes: int) -> None:
        c = calls.setdefault(kind, [0, 0])
        c[0] += n * accum
        c[1] += n * nbytes * accum

    if sp:  # forward entries and backward leaves all-gather, forward leaves and backward entries reduce-scatter
        add("all_gather", regions + again_in + regions, act)
        add("reduce_scatter", regions + again_out + regions, act)
        add("all_reduce", 2 * layers + 1, 2 * param_bytes * args.dim)  # norm gains' gradients
    else:  # entries all-reduce only backward, leaves only forward
        add("all_reduce", regions + regions + again_out, 2 * act)
    add("all_reduce", 1, 2 * 4 * tokens)      # max logit
    add("all_reduce", 1, 2 * 8 * tokens)      # sum-exp and target logit
    if tp > args.n_kv_heads:
        add("all_reduce", 2 * layers, 2 * param_bytes * args.n_kv_heads * args.head_dim * args.dim)
    calls["all_reduce"][0] += 1               # grad norm, once per step
    calls["all_reduce"][1] += 8
    return {k: (v[0], v[1]) for k, v in calls.items()}


def saved_activation_bytes(block: nn.Module, run) -> dict[str, int]:
    """Bytes `block` saves for backward while `run()` does a forward through it, split into
    `norm` (the RMSNorms, i.e. the residual stream they read), `attention`, `feed_forward` and
    `other`. Distinct storages are counted once, parameters not at all."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    where: list[str] = []
    seen: set[int] = set()
    out = {"norm": 0, "attention": 0, "feed_forward": 0, "other": 0}
    handles = []
    for name, mod in block.named_children():
        part = "norm" if isinstance(mod, RMSNorm) else name if name in out else "other"
        handles.append(mod.register_forward_pre_hook(lambda m, a, part=part: where.append(part)))
        handles.append(mod.register_forward_hook(lambda m, a, o: where.pop() and None))
    inside = []
    handles.append(block.register_forward_pre_hook(lambda m, a: inside.append(1)))
    handles.append(block.register_forward_hook(lambda m, a, o: inside.pop() and None))

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if inside and ptr not in params and ptr not in seen:
            seen.add(ptr)
            out[where[-1] if where else "other"] += t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    return out
