"""Every collective goes through a `Comm`: one process group plus byte/time accounting and errors
that say which collective on which group stopped, instead of a silent hang (docs/architecture.md, invariant 4).

Bytes are the logical payload per rank: all-reduce counts 2× the tensor (a reduce-scatter plus an
all-gather), all-gather its output, reduce-scatter its input, send/recv the tensor. That is the
textbook unit (DDP moves 2Ψ, ZeRO-3 3Ψ). `wire_bytes` is what a ring actually puts on a link,
(n-1)/n of it.
"""
from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist


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

    def __init__(self, comm: "Comm", kind: str, work, after=None):
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

    def release(self) -> None:
        """Let go of the group (ParallelContext.close): its C++ object ends with the last reference."""
        self.group, self.watchdog = None, None

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
        return self._run(kind, 2 * t.numel() * t.element_size(), self.ring,
                         lambda **kw: dist.all_reduce(t, op=op, **kw), async_op)

    @_staged
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False, kind: str = "all_gather"):
        """out (size × shard.numel(), contiguous) <- every rank's shard, in rank order. `kind`: the name
        it is booked under (ZeRO++ books its node-local gathers apart: docs/zero.md)."""
        if self.size == 1:
            out.copy_(shard.reshape(out.shape))
            return Handle(self, kind, None) if async_op else None
        return self._run(kind, out.numel() * out.element_size(), self.ring,
                         lambda **kw: _all_gather(out, shard, **kw), async_op)

    @_staged
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """out <- this rank's 1/size slice of the sum of every rank's `full` (flat, divisible)."""
        if self.size == 1:
            out.copy_(full.reshape(out.shape))
            return Handle(self, "reduce_scatter", None) if async_op else None
        nbytes = full.numel() * full.element_size()
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

    def batch_p2p(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """ops: ("send"|"recv", tensor, peer index in this group); started together, returns works."""
        if not ops:
            return []
        if self._host_staged() and any(t.is_cuda for _, t, _ in ops):
            return self._staged_p2p(ops)
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


class Watchdog:
    """Per-rank heartbeats and a small flight recorder in the job's key-value store, so a collective
    that times out names the ranks that never entered it instead of hanging or failing anonymously.

    Every collective a rank enters gets a sequence number per group (the same on every member when
    they agree); the last few are kept in memory. A daemon thread publishes the numbers to the store
    about every `period` seconds (never on the collective's path: a store round trip per collective
    would cost milliseconds per step). A frozen rank stops publishing, so what the others read is
    where it froze, give or take one period; that is how the error can say "rank 1 never entered
    all_reduce #57 on group 'dp'" when both ranks had beaten the same step.
    """

    # Liveness (docs/fault_tolerance.md): besides the progress record, the thread stamps
    # meshlm/alive/{rank} every LIVE_PERIOD s whatever the rank does (a long step included), and reads
    # the others' stamps; a rank silent for `silent_s` is lost (its process or node is gone, or frozen),
    # and `on_silent` gets one line naming the silent ranks: by default it is printed, left for the
    # launcher and the process exits, failing its pending collective at once instead of after
    # parallel.timeout_s, so the elastic agent restarts the survivors within seconds.
    LIVE_PERIOD = 1.0
    JOIN_S = 10.0  # close() waits this long for a store call in flight (one takes milliseconds)

    def __init__(self, store, rank: int, world: int, period: float = 0.2, keep: int = 16,
                 silent_s: float = 0.0, on_silent=None):
        self.store, self.rank, self.world, self.period = store, rank, world, period
        self.silent_s, self.on_silent = silent_s, on_silent or exit_silent
        self._last_live, self._seen = 0.0, {}  # rank -> (stamp text, when it last changed here)
        self.step = -1
        self.seq: dict[str, int] = defaultdict(int)
        self.recent: deque = deque(maxlen=keep)  # (group, seq, kind, step, time)
        self._dirty, self._stop, self._lock = True, threading.Event(), threading.Lock()
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="meshlm-flight-recorder", daemon=True)
        self._thread.start()

    @classmethod
    def for_job(cls, rank: int, world: int, silent_s: float = 0.0, on_silent=None) -> "Watchdog | None":
        if world == 1 or not dist.is_initialized():
            return None
        from torch.distributed.distributed_c10d import _get_default_store
        return cls(_get_default_store(), rank, world, silent_s=silent_s, on_silent=on_silent)

    def beat(self, step: int) -> None:
        self.step = step
        self.store.set(f"meshlm/beat/{self.rank}", str(step))
        self._publish()  # also once a step on the main thread: the record is at most a step old

    def enter(self, group: str, kind: str) -> None:
        """A collective is being issued on `group` (cheap: no store access here)."""
        with self._lock:
            self.seq[group] += 1
            self.recent.append((group, self.seq[group], kind, self.step, time.time()))
            self._dirty = True

    def _publish(self) -> None:
        with self._lock:
            self._dirty = False
            record = {"seq": dict(self.seq), "step": self.step, "time": time.time(),
                      "last": self.recent[-1] if self.recent else None}
        self.store.set(f"meshlm/fr/{self.rank}", json.dumps(record))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                if self._dirty:
                    self._publish()
                if self.silent_s > 0 and time.monotonic() - self._last_live >= self.LIVE_PERIOD:
                    self._live()
            except Exception:  # noqa: BLE001 - the store went away with the job
                if self.silent_s > 0 and not self._stop.is_set():  # not after close(): the job is over
                    self.on_silent(f"rank {self.rank}: the job's store stopped answering (its host is lost; "
                                   f"docs/fault_tolerance.md: keep the store off the worker nodes)")
                return

    def _live(self) -> None:
        """Stamp this rank alive; name the ranks whose stamp has not changed for `silent_s`. Each rank
        judges by its own clock (when it last saw a stamp change), so clocks need not agree."""
        now = time.monotonic()
        self._last_live = now
        self.store.set(f"meshlm/alive/{self.rank}", f"{self.step}:{now}")
        keys = [f"meshlm/alive/{r}" for r in range(self.world) if r != self.rank]
        have = [k for k in keys if self.store.check([k])]
        stamps = dict(zip(have, self.store.multi_get(have))) if have else {}
        silent = []
        for k in keys:
            r, stamp = int(k.rsplit("/", 1)[1]), stamps.get(k)
            old = self._seen.get(r)
            if old is None or old[0] != stamp:
                self._seen[r] = (stamp, now)
            elif stamp not in (None, LEFT.encode()) and now - old[1] > self.silent_s:
                silent.append((r, now - old[1]))
        if silent and not self._stop.is_set():
            names = ", ".join(f"rank {r} (silent {t:.0f} s)" for r, t in silent)
            self._stop.set()
            self.on_silent(f"rank {self.rank}: lost {names} at step {self.step}: no heartbeat for over "
                           f"{self.silent_s:g} s (parallel.heartbeat_s); failing this rank's pending collective so "
                           f"the job can restart")

    def close(self) -> str | None:
        """Stop and join the thread; a rank that leaves on purpose (done, or failing with its own error)
        says so, so the others are not told it was lost. The callback goes too: it is usually a bound
        method of the trainer, and autograd graphs (C++, invisible to Python's cycle collector) hold
        Comms that hold this watchdog, so keeping it would keep the trainer and its process groups alive.

        The join is what makes the exit clean: a daemon thread still inside a store call when the
        interpreter finalizes is ended by pthread_exit while C++ frames are on its stack, and the
        forced unwind through them calls std::terminate ("terminate called without an active
        exception", exit 134 after a finished run). Returns a line when the thread would not stop."""
        self._stop.set()
        self.on_silent = exit_silent
        self._thread.join(self.JOIN_S)
        if self.silent_s > 0:
            try:
                self.store.set(f"meshlm/alive/{self.rank}", LEFT)
            except Exception:  # noqa: BLE001 - the store is gone with the job
                pass
        if self._thread.is_alive():
            return (f"rank {self.rank}: the flight recorder thread did not stop within {self.JOIN_S:g} s "
                    f"(blocked in the job's store)")
        return None

    def _read(self, key: str):
        return self.store.get(key) if self.store.check([key]) else None

    def describe(self, group: str | None = None, ranks: list[int] | None = None) -> str:
        """Who is missing from the collective this rank is stuck in (on `group`), and who is behind."""
        mine = self.seq.get(group, 0) if group else 0
        kind = next((e[2] for e in reversed(self.recent) if e[0] == group), "collective")
        missing, behind = [], []
        try:
            for r in ranks if ranks is not None else range(self.world):
                if r == self.rank:
                    continue
                fr = self._read(f"meshlm/fr/{r}")
                if group and fr is not None:
                    rec = json.loads(fr)
                    theirs = rec["seq"].get(group, 0)
                    if theirs < mine:
                        last = rec["last"]
                        where = (f"last reported: {last[2]} #{last[1]} on '{last[0]}' at step {last[3]}"
                                 if last else "it reported none")
                        missing.append(f"rank {r} never entered {kind} #{mine} on group '{group}' ({where}; "
                                       f"reported {time.time() - rec['time']:.0f} s ago)")
                beat = self._read(f"meshlm/beat/{r}")
                step = int(beat) if beat is not None else -1
                if step < self.step:
                    behind.append(f"rank {r} at step {step}" if step >= 0 else f"rank {r} never started")
        except Exception:  # noqa: BLE001 - the store itself may be gone with the failed peer
            return "; peers' progress unknown (store unreachable)"
        out = "; " + "; ".join(missing) if missing else ""
        if behind:
            out += f"; stopped answering: {', '.join(behind)} (this rank is at step {self.step})"
        return out

    def dump(self) -> None:
        """The flight record of this rank (its last collectives), to stderr, i.e. its log file."""
        print(f"meshlm flight recorder, rank {self.rank} (step {self.step}), last collectives:", file=sys.stderr)
        for group, seq, kind, step, t in self.recent:
            print(f"  {time.strftime('%H:%M:%S', time.localtime(t))} step {step} {kind} #{seq} on '{group}'",
                  file=sys.stderr)


def exit_silent(line: str) -> None:
    """A peer is lost: say so (stderr is the rank's log) and end this process, which fails whatever
    collective the main thread is blocked in (gloo cannot abort one from another thread)."""
    import os
    print(f"meshlm: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


LEFT = "left"  # the alive stamp of a rank whose watchdog closed
EXIT_PEER_LOST = 75  # a worker ended because a peer went silent (not its own failure)


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
