"""The ZeRO gradient synchroniser: gathers, frees and reduces units (units.py) around forward and backward.

What is sharded is a set of named switches (`ZeroSwitches`, zero/__init__.py), not a stage number:
- keep full gradients (zero=1): full parameters and a full fp32 gradient buffer per unit; on the last
  micro-batch a unit's gradient is reduce-scattered as soon as its backward is done. The optimizer
  updates the shard, and the updated shards are all-gathered asynchronously; the next forward waits
  for each unit in turn.
- shard gradients (zero>=2): a unit's full gradient buffer exists only while its backward runs:
  allocated when it starts, reduce-scattered (every micro-batch) into a persistent fp32 shard, dropped.
- shard parameters (zero=3): only parameter shards persist. A unit is gathered just before its forward
  and before its backward and freed after each (reshard after forward), with the next unit's gather
  prefetched. The unit that ends the forward (the head) stays gathered into the backward that starts
  with it, as FSDP2 does for its root.
Each unit reduces as its `Reduction` says: reduce-scatter over the shard group, all-reduce over the
replicas (HSDP), a sum over `sum_at_finish` groups in finish(), then its own divisor.
"""
from __future__ import annotations

from collections import deque
from functools import partial
from itertools import pairwise

import torch
from torch import nn

from ..grad_sync import accumulate_into_view
from .float8 import Float8Gather
from .units import GATHERED, GATHERING, SHARDED, Unit, build_units


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


class ZeroSync:
    """The ZeRO gradient synchroniser (`grad_sync.GradSync`) and owner of the units."""

    def __init__(self, model: nn.Module, named: list[tuple[str, nn.Parameter]], switches, plan,
                 split_tied: bool, reduction_of, reduce_dtype: torch.dtype, zpp=None, float8=None):
        self.switches = switches  # ZeroSwitches: what is sharded
        self.zpp = zpp  # ZeRO++ (zeropp.py): its gathers and gradient reductions replace the plain ones
        self.f8 = None  # float8.py: units holding float8 weights gather in float8 (zero 3, fp8_comm "zero")
        self.reduce_dtype = reduce_dtype
        entry, exit_ = build_units(model, named, plan, split_tied, reduction_of)
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
        self.hooks = []
        if float8 is not None and switches.shard_params:  # (params, dtype): float8.py
            self.f8 = Float8Gather(entry, *float8)
        with torch.no_grad():
            for u in self.units:
                self._init_unit(u)
                if self.f8 is not None and self.f8.covers(u):
                    self.f8.seat(u)
        for u in self.units:
            self.hooks.append(u.first.register_forward_pre_hook(partial(self._pre_forward, u)))
            self.hooks.append(u.last.register_forward_hook(partial(self._post_forward, u)))
            self.hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in u.params]
            for p in u.params:
                p.grad = None

    # -- storage ------------------------------------------------------------------------------
    def _init_unit(self, u: Unit) -> None:
        flat = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
        for i, p in enumerate(u.params):
            u.view(flat, i).copy_(p.detach())
        u.full = flat
        for i, p in enumerate(u.params):  # the parameters are views of the flat buffer from now on
            p.data = u.view(flat, i)
        if not self.switches.shard_params:
            u.shard, u.state = flat[u.lo:u.lo + u.shard_size], GATHERED
        else:
            u.shard = flat[u.lo:u.lo + u.shard_size].clone()
            flat.untyped_storage().resize_(0)
        if not self.switches.shard_grads:
            u.grad_full = torch.zeros(u.padded, dtype=torch.float32, device=u.device)
            u.grad_shard = u.grad_full[u.lo:u.lo + u.shard_size]
            u.grad_views = [u.view(u.grad_full, i) for i in range(len(u.params))]
        # zero 2-3: the shard is allocated by the step's first reduction and freed after the
        # optimizer step, so it never coexists with the forward's activations (as FSDP2 with
        # zero_grad(set_to_none=True))

    # zero 3 frees a unit by resizing the flat buffer's storage to nothing and gathers into the same
    # storage again: the parameters, and any views autograd saved of them (e.g. weight.t() for a
    # matmul), keep pointing at it, so backward reads the re-gathered values and no forward copy
    # survives in the graph.
    def _start_gather(self, u: Unit, backward: bool = False) -> None:
        if u.state != SHARDED:
            return
        if self.f8 is not None and self.f8.covers(u):  # no flat bf16 buffer: float8.py (`backward`: the
            u.handle, u.state = self.f8.gather(u, cols=backward), GATHERING  # experts' backward casts)
            return
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        u.handle = (self.zpp.gather(u) if self.zpp is not None
                    else u.comm.all_gather(u.full, u.shard, async_op=True))
        u.state = GATHERING

    def _unshard(self, u: Unit, backward: bool = False) -> None:
        self._start_gather(u, backward)
        if u.state == GATHERING:
            u.handle.wait()
            u.handle = None
            u.state = GATHERED

    def _reshard(self, u: Unit) -> None:
        if u.handle is not None:
            u.handle.wait()
            u.handle = None
        u.full.untyped_storage().resize_(0)
        if self.f8 is not None and self.f8.covers(u):
            self.f8.release(u)
        u.state = SHARDED

    def wait_params(self) -> None:
        """Finish the post-step all-gathers (zero 1-2) before anyone reads full parameters."""
        for u in self.units:
            if not self.switches.shard_params and u.handle is not None:
                u.handle.wait()
                u.handle = None

    def publish(self) -> None:
        """The shards were updated: zero 1-2 all-gather them into the full parameters (async; the
        forward waits unit by unit); zero 3 gathers on demand anyway."""
        if self.switches.shard_params:
            return
        for u in self.units:
            if u.comm.size == 1:
                continue
            if u.handle is not None:
                u.handle.wait()
            u.handle = u.comm.all_gather(u.full, u.shard, async_op=True)  # in place

    # -- forward / backward hooks ---------------------------------------------------------------
    def _pre_forward(self, u: Unit, module, args) -> None:
        if not self.switches.shard_params:
            if u.handle is not None:
                u.handle.wait()
                u.handle = None
            return
        self._unshard(u)
        if u.next_fwd is not None:
            self._start_gather(u.next_fwd)

    def _post_forward(self, u: Unit, module, args, output):
        grad = torch.is_grad_enabled()
        if self.switches.shard_params and not (grad and (u.keep_after_forward or not self.switches.reshard_after_forward)):
            self._reshard(u)
        if grad and self.switches.shard_grads:
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
        if self.switches.shard_params:
            self._unshard(u, backward=True)
            if u.next_bwd is not None:
                self._start_gather(u.next_bwd, backward=True)
        self._alloc_grad(u)

    def _alloc_grad(self, u: Unit) -> None:
        u.in_backward = True
        u.pending = len(u.params)
        u.grad_full = torch.empty(u.padded, dtype=self.reduce_dtype, device=u.device)
        for a, b in u.gaps:  # the parameters' views are filled by their first gradient (`_on_grad`)
            u.grad_full[a:b].zero_()
        u.grad_views = [u.view(u.grad_full, i) for i in range(len(u.params))]
        self._refill(u)

    def _on_grad(self, p: nn.Parameter) -> None:
        if self.rs_queue or self.ar_queue:
            self._progress(keep=self.inflight)  # retire reductions that finished meanwhile
        u = self.unit_of[id(p)]
        g = p.grad
        if self.switches.shard_grads and not u.in_backward:  # backward reached the unit without its output hook
            self._alloc_grad(u)  # (clears every p.grad of the unit: put autograd's gradient back)
            p.grad = g
        i = u.index[id(p)]
        accumulate_into_view(p, u.grad_views[i], i in u.unfilled)
        u.unfilled.discard(i)
        if not self.switches.shard_grads and not self.sync:
            return
        u.pending -= 1
        if u.pending == 0:
            self._post_backward(u)

    def _post_backward(self, u: Unit) -> None:
        if self.switches.shard_grads:
            for p in u.params:
                p.grad = None
            u.in_backward = False
        if self.switches.shard_params:
            self._reshard(u)
        self._launch_reduce(u)
        if self.switches.shard_grads:
            u.grad_full, u.grad_views = None, []

    def _backward_done(self) -> None:
        """End of a backward pass: reduce units some of whose parameters got no gradient, free any
        gathered units (zero 3)."""
        self.callback_queued = False
        for u in self.units:
            if self.switches.shard_grads and u.in_backward:
                self._post_backward(u)
            if self.switches.shard_params and u.state != SHARDED:
                self._reshard(u)

    # -- reduction ----------------------------------------------------------------------------
    def _refill(self, u: Unit) -> None:
        """The unit's gradient buffer starts over: each parameter's next gradient is copied into its
        view, not added (no zero fill per step or micro-batch), and autograd starts from no `.grad`."""
        u.unfilled = set(range(len(u.params)))
        for p in u.params:
            p.grad = None

    def _launch_reduce(self, u: Unit) -> None:
        u.reduced = True
        for i in u.unfilled:  # no gradient this time: the view still holds an earlier one, or garbage
            u.grad_views[i].zero_()
        u.unfilled = set()
        full = u.grad_full
        send = full if full.dtype == self.reduce_dtype else full.to(self.reduce_dtype)
        if not self.switches.shard_grads and send is full:
            out = u.grad_shard  # in place: NCCL and gloo allow the rank's own slice as output
        else:
            out = torch.empty(u.shard_size, dtype=self.reduce_dtype, device=u.device)
        h = (self.zpp.reduce_scatter(u, out, send) if self.zpp is not None and self.zpp.quantize_grads
             else u.comm.reduce_scatter(out, send, async_op=True))
        self.rs_queue.append((u, h, out, send))
        self._progress(keep=self.inflight)

    def _progress(self, keep: int) -> None:
        """Keep at most `keep` reductions of each kind in flight (bounded memory, still overlapped);
        finished ones are retired too, so their full gradient buffers go as soon as possible."""
        while self.rs_queue and (len(self.rs_queue) > keep or self.rs_queue[0][1].done()):
            u, h, out, _ = self.rs_queue.popleft()
            h.wait()
            over = [c for c in u.reduction.all_reduce_over if c.size > 1]
            for c in over[:-1]:  # more than one replica group: all but the last in turn
                c.all_reduce(out)
            if over:
                self.ar_queue.append((u, over[-1].all_reduce(out, async_op=True), out))
            else:
                self._accumulate(u, out)
        while self.ar_queue and (len(self.ar_queue) > keep or self.ar_queue[0][1].done()):
            u, h, out = self.ar_queue.popleft()
            h.wait()
            self._accumulate(u, out)

    def _accumulate(self, u: Unit, out: torch.Tensor) -> None:
        if out is u.grad_shard:
            return
        if not self.switches.shard_grads:
            u.grad_shard.copy_(out)
        elif u.grad_shard is None:
            u.grad_shard = out.float()  # the fresh reduction output becomes the shard: no copy
        else:
            u.grad_shard.add_(out)

    # -- the interface the trainer drives (as GradBuckets / DataParallel) ----------------------
    def begin_step(self) -> None:
        if self.zpp is not None:
            self.zpp.drop()
        for u in self.units:
            if not self.switches.shard_grads:
                self._refill(u)
            else:
                u.grad_shard = None
            u.pending, u.reduced = len(u.params), False

    def release_grads(self) -> None:
        """After the optimizer step: zero 2-3 drop the gradient shards until the next backward (and
        hpZ its secondary shards, now stale)."""
        if self.zpp is not None:
            self.zpp.drop()
        if self.switches.shard_grads:
            for u in self.units:
                u.grad_shard = None

    def set_sync(self, sync: bool) -> None:
        self.sync = sync  # zero 1 reduces on the last micro-batch only; 2-3 on every one

    def finish(self) -> None:
        if not self.switches.shard_grads:
            for u in self.units:
                if not u.reduced:
                    self._launch_reduce(u)
        self._progress(keep=0)
        for u in self.units:
            if u.grad_shard is None:  # no parameter of the unit got a gradient this step
                u.grad_shard = torch.zeros(u.shard_size, dtype=torch.float32, device=u.device)
        for u in self.units:
            for c in u.reduction.sum_at_finish:
                c.all_reduce(u.grad_shard)
            if u.reduction.divisor != 1:
                u.grad_shard.div_(u.reduction.divisor)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units]

    def held_tensors(self) -> list[torch.Tensor]:
        """What gradient memory this rank holds (train/observe/metrics.py `memory`): zero 1 keeps full buffers."""
        return self.grad_tensors() if self.switches.shard_grads else [u.grad_full for u in self.units]

    def float8_weight(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter `p` as its unit's float8 gather left it: (codes, scale) (float8.py)."""
        return self.f8.weight(p)

    def float8_expert_weight(self, p: nn.Parameter, cols: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert weight `p` as its unit's float8 gather left it: (codes, row or column scales) (float8.py)."""
        return self.f8.expert_weight(p, cols)

    def param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter's range of this rank's reduced gradient shard (empty where it holds none)."""
        out = []
        for u in self.units:
            out += [(p, u.grad_shard[seg.start:seg.end]) for p, seg in zip(u.params, u.pieces)]
        return out
