"""ZeRO stages 1-3 and HSDP over the data-parallel shard group (parallel.zero, parallel.zero_group).

Parameters are grouped into *units*: one per transformer block, the embedding, and the head (norm +
output; embedding and head form one root unit when their weights are tied). A unit's parameters lie
back to back in one flat buffer padded to a multiple of the shard-group size N, and rank r owns the
contiguous slice [r·S, (r+1)·S) of it. Gathers and reductions are then one zero-copy collective per
unit, while `Unit.segments` (this rank's piece of each parameter) keeps everything expressible per
parameter: weight decay per tensor, and checkpoints as full tensors by name (DESIGN invariant 3).

- zero=1: full parameters and a full fp32 gradient buffer per unit; on the last micro-batch a unit's
  gradient is reduce-scattered as soon as its backward is done. The optimizer updates the shard, and
  the updated shards are all-gathered asynchronously; the next forward waits for each unit in turn.
- zero=2: a unit's full gradient buffer exists only while its backward runs: allocated when it starts,
  reduce-scattered (every micro-batch) into a persistent fp32 shard, then dropped.
- zero=3: only parameter shards persist. A unit is gathered just before its forward and before its
  backward and freed after each, with the next unit's gather prefetched. The unit that ends the forward
  (the head) stays gathered into the backward that starts with it, as FSDP2 does for its root.
- HSDP (dp_replicate > 1): each reduced shard is then all-reduced across the replicas.
"""
from __future__ import annotations

from collections import deque
from functools import partial
from itertools import pairwise

import torch
from torch import nn

from ..distributed.comm import Comm, Handle

SHARDED, GATHERING, GATHERED = 0, 1, 2


class Unit:
    """Parameters gathered, reduced and stepped together; `first`/`last` are the modules whose forward
    starts and ends the unit's use."""

    def __init__(self, name: str, params: list[nn.Parameter], names: list[str], first: nn.Module,
                 last: nn.Module, n: int, rank: int):
        self.name, self.params, self.names, self.first, self.last = name, params, names, first, last
        self.dtype, self.device = params[0].dtype, params[0].device
        if any(p.dtype != self.dtype for p in params):
            raise ValueError(f"ZeRO unit {name}: parameters of mixed dtypes")
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        align = max(1, 16 // params[0].element_size())  # 16-byte aligned views for vectorised kernels
        self.offsets, off = [], 0
        for k in self.numels:
            self.offsets.append(off)
            off += -(-k // align) * align
        self.shard_size = -(-off // (n * align)) * align
        self.padded = self.shard_size * n
        self.lo = rank * self.shard_size
        self.index = {id(p): i for i, p in enumerate(params)}
        # (param index, start, end within this rank's shard, start within the flattened parameter)
        self.segments = []
        for i, (o, k) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(o, self.lo), min(o + k, self.lo + self.shard_size)
            if a < b:
                self.segments.append((i, a - self.lo, b - self.lo, a - o))
        self.next_fwd: Unit | None = None  # prefetch targets
        self.next_bwd: Unit | None = None
        self.keep_after_forward = False
        self.full: torch.Tensor | None = None  # the flat parameters (storage freed while sharded)
        self.shard: torch.Tensor | None = None  # this rank's slice, compute dtype
        self.state = SHARDED
        self.handle: Handle | None = None
        self.grad_full: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []  # per-parameter views of grad_full
        self.grad_shard: torch.Tensor | None = None  # fp32, what the optimizer reads (zero 2-3: per step)
        self.pending = len(params)
        self.in_backward = False
        self.reduced = False

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        o = self.offsets[i]
        return flat[o:o + self.numels[i]].view(self.shapes[i])


class _PreBackward(torch.autograd.Function):
    """Identity whose backward runs `hook` first: the gradient reaching a unit's output means the
    unit's own backward is next."""

    @staticmethod
    def forward(ctx, hook, x):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.hook()
        return None, g


def build_units(model: nn.Module, named: list[tuple[str, nn.Parameter]], n: int, rank: int) -> tuple[list[Unit], list[Unit]]:
    """Units in forward order of entry, and of exit (their reverse is the backward order)."""
    name_of = {id(p): name for name, p in named}
    taken: set[int] = set()

    def unit(name: str, mods: list, first=None, last=None) -> Unit | None:
        mods = [m for m in mods if m is not None]
        ps = []
        for m in mods:
            for p in m.parameters():
                if id(p) in name_of and id(p) not in taken:
                    taken.add(id(p))
                    ps.append(p)
        if not ps:
            return None
        return Unit(name, ps, [name_of[id(p)] for p in ps], first or mods[0], last or mods[-1], n, rank)

    emb, norm, out = (getattr(model, k, None) for k in ("tok_embeddings", "norm", "output"))
    tied = emb is not None and out is not None and emb.weight is out.weight
    layers = [unit(f"layers.{k}", [m]) for k, m in getattr(model, "layers", {}).items()]
    layers = [u for u in layers if u is not None]
    if tied:
        root = unit("root", [emb, norm, out])
        head, embed = None, None
    else:
        root = None
        embed = unit("tok_embeddings", [emb])
        head = unit("head", [norm, out])
    rest = unit("rest", [model])  # anything else: held for the whole forward
    entry = [u for u in [rest, root, embed] + layers + [head] if u is not None]
    exit_ = [u for u in [embed] + layers + [head, root, rest] if u is not None]
    return entry, exit_


class Zero:
    """The ZeRO gradient synchroniser (the `grads` the trainer drives) and owner of the units."""

    def __init__(self, model: nn.Module, named: list[tuple[str, nn.Parameter]], stage: int, shard: Comm,
                 replicate: Comm, reduce_dtype: torch.dtype):
        self.stage, self.shard_comm, self.repl_comm = stage, shard, replicate
        self.dp = shard.size * replicate.size
        self.reduce_dtype = reduce_dtype
        entry, exit_ = build_units(model, named, shard.size, shard.rank)
        self.units = entry
        self.unit_of = {id(p): u for u in entry for p in u.params}
        missing = [name for name, p in named if id(p) not in self.unit_of]
        if missing:
            raise ValueError(f"parallel.zero: parameters outside every unit: {', '.join(missing)}")
        for a, b in pairwise(entry):
            a.next_fwd = b
        back = exit_[::-1]
        for a, b in pairwise(back):
            a.next_bwd = b
        back[0].keep_after_forward = True
        # Reductions left in flight behind the newest. NCCL runs them on its own stream, overlapping
        # the next unit's backward. gloo runs them on host threads that compete with the compute for
        # the same cores: keeping one in flight measured no faster on CPU and held its buffers
        # through the next unit's backward (+5% peak, bench/zero.py), so CPU reduces unit by unit.
        self.inflight = 1 if entry[0].device.type == "cuda" else 0
        self.sync = True
        self.callback_queued = False
        self.rs_queue: deque = deque()
        self.ar_queue: deque = deque()
        self.norm_groups: list | None = None
        self.hooks = []
        with torch.no_grad():
            for u in self.units:
                self._init_unit(u)
        for u in self.units:
            self.hooks.append(u.first.register_forward_pre_hook(partial(self._pre_forward, u)))
            self.hooks.append(u.last.register_forward_hook(partial(self._post_forward, u)))
            for p in u.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # -- storage ------------------------------------------------------------------------------
    def _init_unit(self, u: Unit) -> None:
        flat = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
        for i, p in enumerate(u.params):
            u.view(flat, i).copy_(p.detach())
        u.full = flat
        for i, p in enumerate(u.params):  # the parameters are views of the flat buffer from now on
            p.data = u.view(flat, i)
        if self.stage < 3:
            u.shard, u.state = flat[u.lo:u.lo + u.shard_size], GATHERED
        else:
            u.shard = flat[u.lo:u.lo + u.shard_size].clone()
            flat.untyped_storage().resize_(0)
        if self.stage == 1:
            u.grad_full = torch.zeros(u.padded, dtype=torch.float32, device=u.device)
            u.grad_shard = u.grad_full[u.lo:u.lo + u.shard_size]
            u.grad_views = [u.view(u.grad_full, i) for i in range(len(u.params))]
            for p, v in zip(u.params, u.grad_views):
                if p.dtype == torch.float32:
                    p.grad = v  # autograd accumulates straight into the buffer
        # zero 2-3: the shard is allocated by the step's first reduction and freed after the
        # optimizer step, so it never coexists with the forward's activations (as FSDP2 with
        # zero_grad(set_to_none=True))

    # zero 3 frees a unit by resizing the flat buffer's storage to nothing and gathers into the same
    # storage again: the parameters, and any views autograd saved of them (e.g. weight.t() for a
    # matmul), keep pointing at it, so backward reads the re-gathered values and no forward copy
    # survives in the graph.
    def _start_gather(self, u: Unit) -> None:
        if u.state != SHARDED:
            return
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        u.handle = self.shard_comm.all_gather(u.full, u.shard, async_op=True)
        u.state = GATHERING

    def _unshard(self, u: Unit) -> None:
        self._start_gather(u)
        if u.state == GATHERING:
            u.handle.wait()
            u.handle = None
            u.state = GATHERED

    def _reshard(self, u: Unit) -> None:
        if u.handle is not None:
            u.handle.wait()
            u.handle = None
        u.full.untyped_storage().resize_(0)
        u.state = SHARDED

    def wait_params(self) -> None:
        """Finish the post-step all-gathers (zero 1-2) before anyone reads full parameters."""
        for u in self.units:
            if self.stage < 3 and u.handle is not None:
                u.handle.wait()
                u.handle = None

    def publish(self) -> None:
        """The shards were updated: zero 1-2 all-gather them into the full parameters (async; the
        forward waits unit by unit); zero 3 gathers on demand anyway."""
        if self.stage == 3 or self.shard_comm.size == 1:
            return
        for u in self.units:
            if u.handle is not None:
                u.handle.wait()
            u.handle = self.shard_comm.all_gather(u.full, u.shard, async_op=True)  # in place

    # -- forward / backward hooks ---------------------------------------------------------------
    def _pre_forward(self, u: Unit, module, args) -> None:
        if self.stage < 3:
            if u.handle is not None:
                u.handle.wait()
                u.handle = None
            return
        self._unshard(u)
        if u.next_fwd is not None:
            self._start_gather(u.next_fwd)

    def _post_forward(self, u: Unit, module, args, output):
        grad = torch.is_grad_enabled()
        if self.stage == 3 and not (grad and u.keep_after_forward):
            self._reshard(u)
        if grad and self.stage >= 2:
            hook = partial(self._pre_backward, u)
            if isinstance(output, torch.Tensor):
                return _PreBackward.apply(hook, output) if output.requires_grad else output
            if isinstance(output, tuple):
                return tuple(_PreBackward.apply(hook, o) if isinstance(o, torch.Tensor) and o.requires_grad
                             else o for o in output)
        return output

    def _pre_backward(self, u: Unit) -> None:
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self.callback_queued = True
        if u.in_backward:
            return
        if self.stage == 3:
            self._unshard(u)
            if u.next_bwd is not None:
                self._start_gather(u.next_bwd)
        self._alloc_grad(u)

    def _alloc_grad(self, u: Unit) -> None:
        u.in_backward = True
        u.pending = len(u.params)
        u.grad_full = torch.zeros(u.padded, dtype=self.reduce_dtype, device=u.device)
        u.grad_views = [u.view(u.grad_full, i) for i in range(len(u.params))]
        for p, v in zip(u.params, u.grad_views):
            if p.dtype == self.reduce_dtype:
                p.grad = v

    def _on_grad(self, p: nn.Parameter) -> None:
        if self.rs_queue or self.ar_queue:
            self._progress(keep=self.inflight)  # retire reductions that finished meanwhile
        u = self.unit_of[id(p)]
        g = p.grad
        if self.stage >= 2 and not u.in_backward:  # backward reached the unit without its output hook
            self._alloc_grad(u)
        view = u.grad_views[u.index[id(p)]]
        if g is not view:
            view.add_(g)
            p.grad = None
        if self.stage == 1 and not self.sync:
            return
        u.pending -= 1
        if u.pending == 0:
            self._post_backward(u)

    def _post_backward(self, u: Unit) -> None:
        if self.stage >= 2:
            for p in u.params:
                p.grad = None
            u.in_backward = False
        if self.stage == 3:
            self._reshard(u)
        self._launch_reduce(u)
        if self.stage >= 2:
            u.grad_full, u.grad_views = None, []

    def _backward_done(self) -> None:
        """End of a backward pass: reduce units some of whose parameters got no gradient, free any
        gathered units (zero 3)."""
        self.callback_queued = False
        for u in self.units:
            if self.stage >= 2 and u.in_backward:
                self._post_backward(u)
            if self.stage == 3 and u.state != SHARDED:
                self._reshard(u)

    # -- reduction ----------------------------------------------------------------------------
    def _launch_reduce(self, u: Unit) -> None:
        u.reduced = True
        full = u.grad_full
        send = full if full.dtype == self.reduce_dtype else full.to(self.reduce_dtype)
        if self.stage == 1 and send is full:
            out = u.grad_shard  # in place: NCCL and gloo allow the rank's own slice as output
        else:
            out = torch.empty(u.shard_size, dtype=self.reduce_dtype, device=u.device)
        h = self.shard_comm.reduce_scatter(out, send, async_op=True)
        self.rs_queue.append((u, h, out, send))
        self._progress(keep=self.inflight)

    def _progress(self, keep: int) -> None:
        """Keep at most `keep` reductions of each kind in flight (bounded memory, still overlapped);
        finished ones are retired too, so their full gradient buffers go as soon as possible."""
        while self.rs_queue and (len(self.rs_queue) > keep or self.rs_queue[0][1].done()):
            u, h, out, _ = self.rs_queue.popleft()
            h.wait()
            if self.repl_comm.size > 1:
                self.ar_queue.append((u, self.repl_comm.all_reduce(out, async_op=True), out))
            else:
                self._accumulate(u, out)
        while self.ar_queue and (len(self.ar_queue) > keep or self.ar_queue[0][1].done()):
            u, h, out = self.ar_queue.popleft()
            h.wait()
            self._accumulate(u, out)

    def _accumulate(self, u: Unit, out: torch.Tensor) -> None:
        if out is u.grad_shard:
            return
        if self.stage == 1:
            u.grad_shard.copy_(out)
        elif u.grad_shard is None:
            u.grad_shard = out.float()  # the fresh reduction output becomes the shard: no copy
        else:
            u.grad_shard.add_(out)

    # -- the interface the trainer drives (as GradBuckets / DataParallel) ----------------------
    def begin_step(self) -> None:
        for u in self.units:
            if self.stage == 1:
                u.grad_full.zero_()
            else:
                u.grad_shard = None
            u.pending, u.reduced = len(u.params), False

    def release_grads(self) -> None:
        """After the optimizer step: zero 2-3 drop the gradient shards until the next backward."""
        if self.stage >= 2:
            for u in self.units:
                u.grad_shard = None

    def set_sync(self, sync: bool) -> None:
        self.sync = sync  # zero 1 reduces on the last micro-batch only; 2-3 on every one

    def finish(self) -> None:
        if self.stage == 1:
            for u in self.units:
                if not u.reduced:
                    self._launch_reduce(u)
        self._progress(keep=0)
        for u in self.units:
            if u.grad_shard is None:  # no parameter of the unit got a gradient this step
                u.grad_shard = torch.zeros(u.shard_size, dtype=torch.float32, device=u.device)
        torch._foreach_div_(self.grad_tensors(), float(self.dp))

    def grad_tensors(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units]

    def held_tensors(self) -> list[torch.Tensor]:
        """What gradient memory this rank holds (Trainer.memory): zero 1 keeps full buffers."""
        return [u.grad_full for u in self.units] if self.stage == 1 else self.grad_tensors()

    def set_norm_groups(self, groups: list[tuple[list[nn.Parameter], list[Comm]]]) -> None:
        """Tensor parallelism: which parameters are also sharded over which comms (see GradBuckets)."""
        self.norm_groups = [([id(p) for p in params], comms) for params, comms in groups]

    def norm_terms(self) -> list[tuple[list[torch.Tensor], list[Comm]]]:
        """Each rank's gradient shards, summed over the shard group (not dp_replicate: replicas)."""
        if self.norm_groups is None:
            return [(self.grad_tensors(), [self.shard_comm])]
        out = []
        for ids, comms in self.norm_groups:
            want = set(ids)
            ts = [u.grad_shard[s0:s1] for u in self.units for i, s0, s1, _ in u.segments
                  if id(u.params[i]) in want]
            out.append((ts, [self.shard_comm] + list(comms)))
        return out

    def gather_flat(self, u: Unit, t: torch.Tensor) -> torch.Tensor:
        """The whole padded flat buffer of `u` from every rank's shard `t` (checkpoints)."""
        t = t.to(u.device)
        out = torch.empty(u.padded, dtype=t.dtype, device=u.device)
        self.shard_comm.all_gather(out, t)
        return out


def shard_model(model: nn.Module, named: list[tuple[str, nn.Parameter]], ctx, cfg) -> tuple[object, Zero]:
    """What `parallelize` uses for zero >= 1: (optimizer, gradient synchroniser)."""
    from .data_parallel import DTYPES
    from .zero_optim import ZeroOptimizer

    p = cfg.parallel
    zero = Zero(model, named, p.zero, ctx.comm("dp_shard"), ctx.comm("dp_replicate"), DTYPES[p.reduce_dtype])
    return ZeroOptimizer(zero, cfg.optim, p.offload == "optimizer"), zero
