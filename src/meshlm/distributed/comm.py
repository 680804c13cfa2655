"""Every collective goes through a `Comm`: one process group plus byte/time accounting and errors
that say which collective on which group stopped, instead of a silent hang (docs/architecture.md, invariant 4).

Bytes are the logical payload per rank: all-reduce counts 2× the tensor (a reduce-scatter plus an
all-gather), all-gather its output, reduce-scatter its input, send/recv the tensor. That is the
textbook unit (DDP moves 2Ψ, ZeRO-3 3Ψ). `wire_bytes` is what a ring actually puts on a link,
(n-1)/n of it.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshlm.distributed import direct, sockets

# The non-deprecated names where torch has them (same semantics).
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the collective and the group."""


@dataclass
class Stat:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0


class Handle:
    """An in-flight async collective; `wait()` books the time blocked in it."""

    def __init__(self, comm: Comm, kind: str, work, after=None):
        self.comm, self.kind, self.work, self.after = comm, kind, work, after

    def done(self) -> bool:
        """Whether the collective has finished (then `wait()` returns at once); never blocks."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            t0 = time.perf_counter()
            self.comm._guard(self.kind, self.work.wait)
            self.comm.stats[self.kind].seconds += time.perf_counter() - t0
            self.work = None
        if self.after is not None:
            self.after()
            self.after = None


def _staged(method):
    """Through host memory when this group is gloo and the tensors are on a GPU: ranks that share one
    GPU (more local ranks than devices, `mesh.pick_device`) cannot use NCCL, which refuses two ranks on
    one device, and gloo does not take every collective on CUDA tensors (docs/architecture.md, "Ranks
    sharing a GPU"). The first argument is the output, filled in place; async calls complete at once."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        if not (self._host_staged() and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)):
            return method(self, *args, **kw)
        host = [a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in args]
        wanted_async = kw.pop("async_op", False)
        method(self, *host, **kw)
        args[0].copy_(host[0])
        return Handle(self, method.__name__, None) if wanted_async else None
    return run


class Comm:
    """A process group along one mesh dimension. With one member every operation is a no-op."""

    def __init__(self, name: str, group, ranks: list[int], rank: int):
        self.name, self.group, self.ranks, self.global_rank = name, group, list(ranks), rank
        self.size = len(ranks)
        self.rank = self.ranks.index(rank)
        self.stats: dict[str, Stat] = defaultdict(Stat)
        self.watchdog = None  # set by the trainer: names lagging ranks when a collective times out
        self._native_rs: bool | None = None  # gloo: does this torch build have reduce_scatter?
        self._gloo: bool | None = None  # is the group gloo (CUDA tensors then go through host memory)?
        self._links: sockets.Links | bool | None = None  # gloo on one host: sockets; False: not usable

    def release(self) -> None:
        """Let go of the group (ParallelContext.close): its C++ object ends with the last reference."""
        if self._links:
            self._links.close()
        self.group, self.watchdog, self._links = None, None, None

    # -- accounting ---------------------------------------------------------------------------
    def _book(self, kind: str, nbytes: int, wire_factor: float) -> None:
        s = self.stats[kind]
        s.calls += 1
        s.bytes += nbytes
        s.wire_bytes += nbytes * wire_factor

    def _guard(self, kind: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # gloo/nccl timeouts and peer failures surface here
            wd = self.watchdog
            lag = wd.describe(self.name, self.ranks) if wd is not None else ""
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if wd is not None:
                wd.dump()  # this rank's last collectives, to its log
            raise CollectiveError(f"rank {self.global_rank}: {kind} on group '{self.name}' (ranks "
                                  f"{self.ranks}) failed: {first[:300]}{lag}") from e

    def _enter(self, kind: str) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(self.name, kind)

    def _run(self, kind: str, nbytes: int, wire_factor: float, fn, async_op: bool, after=None, **kw):
        self._book(kind, nbytes, wire_factor)
        self._enter(kind)
        if not async_op:
            t0 = time.perf_counter()
            self._guard(kind, fn, group=self.group, async_op=False, **kw)
            self.stats[kind].seconds += time.perf_counter() - t0
            if after is not None:
                after()
            return None
        work = self._guard(kind, fn, group=self.group, async_op=True, **kw)
        return Handle(self, kind, work, after)

    def _direct(self, op=dist.ReduceOp.SUM) -> bool:
        """gloo's collectives as one all-to-all hop each (distributed/direct.py)."""
        return self._host_staged() and direct.enabled() and direct.supports(op)

    def _run_direct(self, kind: str, nbytes: int, async_op: bool, start):
        """`_run` for a direct algorithm: `start(async_op)` -> (work, finish); finish runs after the
        work, where a native collective's result would be ready (at once, or at the handle's wait)."""
        finish = []

        def begin(group, async_op):
            work, done = start(async_op)
            finish.append(done)
            return work
        return self._run(kind, nbytes, self.ring, begin, async_op, after=lambda: finish[0]())

    def _socket_links(self) -> sockets.Links | None:
        """This gloo group's sockets (distributed/sockets.py), connected at the first synchronous
        exchange; None when its members are not all on this host or MESHLM_GLOO_SOCKETS=0."""
        if self._links is None:
            self._links = (sockets.enabled() and sockets.Links.connect(self.group, self.rank, self.size)) or False
        return self._links or None

    def _swap(self, recv: torch.Tensor, send: torch.Tensor, async_op: bool):
        """recv <- block r of every member's `send`, in member order (flat, equal blocks): over the
        group's sockets when synchronous, else gloo's all-to-all (its work is returned)."""
        links = None if async_op else self._socket_links()
        if links is None:
            return dist.all_to_all_single(recv, send, group=self.group, async_op=async_op)
        links.exchange(list(recv.chunk(self.size)), list(send.chunk(self.size)))
        return None

    def _host_staged(self) -> bool:
        if self._gloo is None:
            self._gloo = self.group is not None and dist.get_backend(self.group) == "gloo"
        return self._gloo

    @property
    def ring(self) -> float:
        return (self.size - 1) / self.size

    # -- collectives --------------------------------------------------------------------------
    @_staged
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False, kind: str = "all_reduce"):
        """`kind`: the name it is booked under (float8's shared amax books apart: float8_comm.py)."""
        if self.size == 1:
            return Handle(self, kind, None) if async_op else None
        if not async_op and self._direct(op):
            return self._run(kind, 2 * t.numel() * t.element_size(), self.ring,
                             lambda **_: direct.all_reduce(t, self.size, op, self._swap), False)
        return self._run(kind, 2 * t.numel() * t.element_size(), self.ring,
                         lambda **kw: dist.all_reduce(t, op=op, **kw), async_op)

    @_staged
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False, kind: str = "all_gather"):
        """out (size × shard.numel(), contiguous) <- every rank's shard, in rank order. `kind`: the name
        it is booked under (ZeRO++ books its node-local gathers apart: docs/zero.md)."""
        if self.size == 1:
            out.copy_(shard.reshape(out.shape))
            return Handle(self, kind, None) if async_op else None
        if self._direct():
            return self._run_direct(kind, out.numel() * out.element_size(), async_op,
                                    lambda a: direct.all_gather(out, shard, self.size, self._swap, a))
        return self._run(kind, out.numel() * out.element_size(), self.ring,
                         lambda **kw: _all_gather(out, shard, **kw), async_op)

    @_staged
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """out <- this rank's 1/size slice of the sum of every rank's `full` (flat, divisible)."""
        if self.size == 1:
            out.copy_(full.reshape(out.shape))
            return Handle(self, "reduce_scatter", None) if async_op else None
        nbytes = full.numel() * full.element_size()
        if self._direct(op):
            return self._run_direct("reduce_scatter", nbytes, async_op,
                                    lambda a: direct.reduce_scatter(out, full, self.size, op, self._swap, a))
        if not self._has_reduce_scatter():
            # Older gloo has no reduce-scatter: all-reduce a copy and keep our slice. The accounting
            # still books a reduce-scatter, the collective an NCCL job would run.
            tmp = full.detach().clone()
            n = out.numel()

            def keep() -> None:
                out.copy_(tmp.view(-1)[self.rank * n:(self.rank + 1) * n].view(out.shape))
            return self._run("reduce_scatter", nbytes, self.ring,
                             lambda **kw: dist.all_reduce(tmp, op=op, **kw), async_op, after=keep)
        return self._run("reduce_scatter", nbytes, self.ring,
                         lambda **kw: _reduce_scatter(out, full, op=op, **kw), async_op)

    @_staged
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, async_op: bool = False, kind: str = "all_to_all"):
        """Rank r sends `inp`'s i-th block (dim 0) to rank i and receives rank i's r-th block into `out`'s
        i-th block, in rank order; blocks are equal, or sized by the splits (rows along dim 0). Booked:
        the bytes this rank sends, (size-1)/size of them cross a link."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return Handle(self, kind, None) if async_op else None
        links = None if async_op or not self._host_staged() else self._guard(kind, self._socket_links)
        if links is not None and out.is_contiguous() and inp.is_contiguous():
            def swap(**_):
                links.exchange(list(out.split(out_splits or out.shape[0] // self.size)),
                               list(inp.split(in_splits or inp.shape[0] // self.size)))
            return self._run(kind, inp.numel() * inp.element_size(), self.ring, swap, False)
        return self._run(kind, inp.numel() * inp.element_size(), self.ring,
                         lambda **kw: dist.all_to_all_single(out, inp, out_splits, in_splits, **kw), async_op)

    def _has_reduce_scatter(self) -> bool:
        """Recent gloo builds reduce-scatter natively; older ones raise at once on every rank, so a
        tiny probe (not booked) on the first call decides, the same way on all members."""
        if self._native_rs is None:
            self._native_rs = True
            if dist.get_backend(self.group) == "gloo":
                try:
                    _reduce_scatter(torch.zeros(1), torch.zeros(self.size), group=self.group)
                except RuntimeError:
                    self._native_rs = False
        return self._native_rs

    @_staged
    def broadcast(self, t: torch.Tensor, src_index: int = 0) -> None:
        if self.size == 1:
            return
        self._run("broadcast", t.numel() * t.element_size(), 1.0,
                  lambda **kw: dist.broadcast(t, group_src=src_index, **kw), False)

    def barrier(self) -> None:
        if self.size > 1:
            self._enter("barrier")
            self._guard("barrier", dist.barrier, group=self.group)

    def batch_p2p(self, ops: list[tuple[str, torch.Tensor, int]], symmetric: bool = False) -> list:
        """ops: ("send"|"recv", tensor, peer index in this group); started together, returns works.
        `symmetric`: every member makes the matching call at the same point (a ring shift), so on one
        host's gloo group it completes here, over the sockets (distributed/sockets.py), and returns []."""
        if not ops:
            return []
        if self._host_staged() and any(t.is_cuda for _, t, _ in ops):
            return self._staged_p2p(ops)
        links = self._guard("send/recv", self._socket_links) if symmetric and self._host_staged() else None
        if links is not None and all(t.is_contiguous() for _, t, _ in ops):
            for kind, t, _ in ops:
                self._book(kind, t.numel() * t.element_size(), 1.0)
            t0 = time.perf_counter()
            self._guard("send/recv", links.move, {p: t for k, t, p in ops if k == "send"},
                        {p: t for k, t, p in ops if k == "recv"})
            self.stats["recv_wait"].seconds += time.perf_counter() - t0
            return []
        p2p = []
        for kind, t, peer in ops:
            self._book(kind, t.numel() * t.element_size(), 1.0)
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, t, self.ranks[peer], group=self.group))
        # not numbered: pipeline stages send different numbers of messages by design
        return self._guard("send/recv", dist.batch_isend_irecv, p2p)

    def _staged_p2p(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """batch_p2p through host memory (see `_staged`), waited for here: received tensors are filled
        when it returns, and the works returned are already complete."""
        host = [(kind, t.detach().cpu(), peer) for kind, t, peer in ops]
        works = self.batch_p2p(host)
        self.wait_p2p(works)
        for (kind, t, _), (_, h, _) in zip(ops, host):
            if kind == "recv":
                t.copy_(h)
        return []

    def wait_p2p(self, works: list) -> None:
        t0 = time.perf_counter()
        for w in works:
            self._guard("send/recv", w.wait)
        self.stats["recv_wait"].seconds += time.perf_counter() - t0

    def all_reduce_scalars(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """Reduce a few host floats (loss sums, norms, inf flags) in one small collective."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self.all_reduce(t, op=op)
        return t.tolist()


def merge_stats(comms: list[Comm]) -> dict[str, Stat]:
    """Totals per collective kind over several groups (each group counted once)."""
    out: dict[str, Stat] = defaultdict(Stat)
    for c in comms:
        for kind, s in c.stats.items():
            o = out[kind]
            o.calls += s.calls
            o.bytes += s.bytes
            o.wire_bytes += s.wire_bytes
            o.seconds += s.seconds
    return dict(out)


def reset_stats(comms: list[Comm]) -> None:
    for c in comms:
        c.stats.clear()
