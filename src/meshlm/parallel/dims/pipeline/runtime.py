"""The pipeline executor: runs one rank's action list from `build_schedule` on real tensors.

It follows the p2p rules of p2p.py: items are taken in list order; a run of adjacent SEND/RECV
actions is one `Comm.batch_p2p` call whose receives are waited before the next compute. Its sends are
waited at the end of the step where the backend gives one work per operation (gloo): that only removes
blocking from the rendezvous model the checker proves deadlock-free, and a sender no longer idles
until its receiver reaches the matching RECV when real costs differ from the ones p2p was placed by
(torch.distributed.pipelining waits for its receives only, too). A RECV may come long before its consumer, so received tensors
wait in `inbox` keyed by (kind, mb, chunk); produced tensors wait in `outbox` until their SEND.
A consumer on the same rank (the turn of ZB-V's V) gets the tensor straight into `inbox`.
Activation shapes are known in advance (micro-batch × local sequence × dim, the compute dtype).

Backward kinds: B is one `autograd.backward`; the zero-bubble I and W are in backward.py (I sends
the input gradient on at once; W later runs only the weight-gradient products).

Uneven data parallelism (parallel.dp_weights): `m` is this replica's own count, or the longest where
collectives span replicas on every micro-batch; then micro-batches `accum` and on are padding, as
parallel/step.py `Accumulation` pads: the first micro-batch again, its loss times 0, counted in nothing.

Gradient sync: every compute runs with `grads.set_sync(False)` except the last weight-producing
backward (B or W) of each chunk, so DP buckets and ZeRO-1 reductions fire once per step, right after
each chunk's gradients are final, overlapping the rest of the schedule. With tied embeddings the two
copies (first and last stage) are summed in `finish()` (their `Reduction.sum_at_finish`, grad_sync.py).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from ....data.sampler import Batch
from ....distributed.comm import Comm
from ....core.schedule.actions import Action, local_target, message_of, source_of
from ....core.schedule.replay import p2p_batches
from .backward import input_backward


def sync_points(items: list) -> list[int]:
    """Item index of the last weight-gradient backward of each chunk, in item order: where a step's
    gradient reductions fire (uneven replicas rely on their chunk order not depending on the count)."""
    last: dict[int, int] = {}
    for i, it in enumerate(items):
        if not isinstance(it, tuple) and it.kind in ("B", "W"):
            last[it.chunk] = i
    return sorted(last.values())


class Stage:
    """One local chunk: a view over the rank's pruned model (the same modules, looked up at call time,
    so activation checkpointing and compile wrappers apply), run by the model's own forward."""

    def __init__(self, model: nn.Module, plan, keys: list[str], index: int, first: bool, last: bool):
        self.model, self.plan, self.keys, self.index, self.first, self.last = model, plan, keys, index, first, last

    def __call__(self, x: torch.Tensor, seq_len: int, docs: torch.Tensor | None = None) -> torch.Tensor:
        return self.plan.run_stage(self.model, x, self.keys, self.first, self.last, seq_len, docs)

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for mod in self.plan.stage_modules(self.model, self.keys, self.first, self.last):
            for p in mod.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


class PipelineRuntime:
    """Drives `stages` (this rank's chunks, by chunk index) through `actions[rank]` each step.

    `schedule_for(m)` builds (and checks) the action lists of a step of m micro-batches of `micro_batch`
    sequences: a step runs the schedule of as many micro-batches as its batch holds, so under
    training.batch_rampup the ramp's smaller steps run shorter schedules (each built once, on first use).
    The stage split does not depend on m, so every step runs over the same stages. `pad_to` and
    `counted`: parallel.dp_weights' padding (the module's docstring)."""

    def __init__(self, stages: list[Stage], schedule_for: Callable[[int], list[list[Action]]], rank: int,
                 comm: Comm, grads, loss_fn: Callable, dtype: torch.dtype, device: torch.device,
                 act_shape: Callable[[int, int], tuple[int, ...]], micro_batch: int, m: int, schedule: str = "",
                 split_w: bool = True, vshape: bool = False, pad_to: int = 0, counted=()):
        self.stages, self.rank, self.comm, self.v = stages, rank, comm, len(stages)
        self.grads, self.loss_fn, self.dtype, self.device = grads, loss_fn, dtype, device
        self.act_shape, self.schedule, self.split_w, self.vshape = act_shape, schedule, split_w, vshape
        self.schedule_for, self.micro_batch = schedule_for, micro_batch
        self.pad_to, self.counted = pad_to, tuple(counted)
        self._plans: dict[int, tuple] = {}
        self._use(m)
        self.inbox: dict = {}
        self.outbox: dict = {}
        self.saved: dict = {}
        self.deferred: dict = {}
        self.sending: list = []  # (work, tensor) of sends posted this step, waited at its end
        self._clock: _Clock | None = None  # spans of the last timed step, resolved only when read

    def _use(self, accum: int) -> None:
        """Run steps of `accum` micro-batches with data from now on (padded to `pad_to`): their actions,
        p2p items and sync points."""
        m = max(accum, self.pad_to)
        if m not in self._plans:
            actions = self.schedule_for(m)
            items = p2p_batches(actions[self.rank])
            self._plans[m] = (actions, items, set(sync_points(items)))
        self.m, self.accum, self.passes = m, accum, m
        self.actions, self.items, self.sync_items = self._plans[m]
        self.p = len(self.actions)

    # -- one training step ----------------------------------------------------------------------
    def run(self, batch: Batch, scale: float | torch.Tensor = 1.0, timed: bool = False) -> torch.Tensor:
        """All micro-batches of one step on this rank (parallel/step.py `StepRunner`); returns the sum
        of the micro-batch losses (zero on every stage but the last). `docs`: per-token document ids
        (document masking), split like the inputs. `timed`: on CUDA the clock drains the compute
        stream once per timed step, so the trainer times its logged steps only (their bubble)."""
        inputs, targets, docs = batch
        if inputs.shape[0] % self.micro_batch:
            raise ValueError(f"pipeline: {inputs.shape[0]} sequences do not split into micro-batches of "
                             f"{self.micro_batch}")
        self._use(inputs.shape[0] // self.micro_batch)
        n, seq = self.micro_batch, inputs.shape[1]
        xs, ys = inputs.split(n), targets.split(n)
        ds = docs.split(n) if docs is not None else [None] * self.accum
        shape = self.act_shape(n, seq)
        loss_sum = torch.zeros((), device=self.device)
        clock = _Clock(self.device) if timed else None
        self.grads.begin_step()
        self.grads.set_sync(False)
        try:
            for i, it in enumerate(self.items):
                if clock is not None:
                    clock.start()
                if isinstance(it, tuple):
                    self._p2p(it, shape)
                else:
                    sync = i in self.sync_items
                    if sync:
                        self.grads.set_sync(True)
                    loss = self._compute(it, xs, ys, ds, seq, scale)
                    if sync:
                        self.grads.set_sync(False)
                    if loss is not None:
                        loss_sum += loss
                if clock is not None:
                    clock.stop()
        finally:
            self.grads.set_sync(True)
            self._padding(False)
        self.comm.wait_p2p([w for w, _ in self.sending])
        self.sending = []
        left = [k for box in (self.inbox, self.outbox, self.saved, self.deferred) for k in box]
        if left:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule left tensors unconsumed: {left[:4]}")
        self.grads.finish()
        self._clock = clock
        return loss_sum

    def _padding(self, on: bool) -> None:
        if self.passes > self.accum:
            for c in self.counted:
                c.padding(on)

    def _compute(self, a: Action, xs, ys, ds, seq: int, scale: float | torch.Tensor):
        st, key = self.stages[a.chunk], (a.mb, a.chunk)
        if a.kind == "F":
            pad = a.mb >= self.accum  # a padding micro-batch: the first one again, loss times 0
            mb = 0 if pad else a.mb
            self._padding(pad)
            if st.first:
                x = xs[mb]
            else:
                x = self.inbox.pop(("F",) + key).requires_grad_(True)
            out = st(x, seq, ds[mb])
            loss = None
            if st.last:
                loss = self.loss_fn(out, ys[mb])
                out = loss * (0.0 if pad else scale)
                loss = None if pad else loss.detach()
            else:
                self._hand_off(a, out.detach())
            self.saved[key] = (x, out)
            return loss
        if a.kind in ("B", "I"):
            x, out = self.saved.pop(key)
            g = None if st.last else self.inbox.pop(("B",) + key)
            if a.kind == "B":
                torch.autograd.backward(out, g)
                if not st.first:
                    self._hand_off(a, x.grad)
            else:
                gx, self.deferred[key] = input_backward(out, g, None if st.first else x, st.parameters(),
                                                        self.split_w)
                if gx is not None:
                    self._hand_off(a, gx)
            return None
        self.deferred.pop(key).weight()  # W
        return None

    def _hand_off(self, a: Action, t: torch.Tensor) -> None:
        """What compute `a` produced: to the local consumer's inbox, or to the outbox for a SEND."""
        local = local_target(a, self.rank, self.p, self.v, self.vshape)
        if local is None:
            self.outbox[("F" if a.kind == "F" else "B", a.mb, a.chunk)] = t
        else:
            self.inbox[(local[0], a.mb, local[1])] = t

    def _p2p(self, batch: tuple[Action, ...], shape: tuple[int, ...]) -> None:
        ops = []
        for a in batch:
            key = (a.kind[-1], a.mb, a.chunk)
            if a.is_send:
                ops.append(("send", self.outbox.pop(key).to(self.dtype).contiguous(), a.peer))
            else:
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                self.inbox[key] = buf
                ops.append(("recv", buf, a.peer))
        works = self.comm.batch_p2p(ops)
        if len(works) == len(ops):  # one work per op: sends finish in the background (their tensors kept)
            done = [w for w, _ in self.sending if w.is_completed()]  # let finished sends' tensors go now,
            self.comm.wait_p2p(done)  # not at the step's end (wait: an error still surfaces, at no cost)
            self.sending = [(w, t) for w, t in self.sending if w not in done]
            self.sending += [(w, op[1]) for w, op in zip(works, ops) if op[0] == "send"]
            works = [w for w, op in zip(works, ops) if op[0] == "recv"]
        self.comm.wait_p2p(works)

    # -- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """Forward of one micro-batch through every stage in order (blocking p2p: stage s waits for
        s-1, a chain that cannot deadlock: each rank's chunks hold increasing stages in both placements).
        The mean loss on the last stage, zero elsewhere."""
        x, y, docs = batch
        seq = x.shape[1]
        shape = self.act_shape(x.shape[0], seq)
        loss = torch.zeros((), device=self.device)
        local: dict[int, torch.Tensor] = {}
        order = sorted(range(self.v), key=lambda c: self.stages[c].index)
        for c in order:
            st, fwd = self.stages[c], Action("F", 0, c)
            if st.first:
                h = x
            elif c in local:
                h = local.pop(c)
            else:
                h = torch.empty(shape, dtype=self.dtype, device=self.device)
                src = source_of(fwd, self.rank, self.p, self.v, self.vshape)[0]
                self.comm.wait_p2p(self.comm.batch_p2p([("recv", h, src)]))
            out = st(h, seq, docs)
            if st.last:
                loss = self.loss_fn(out, y).detach()
                continue
            nxt = local_target(fwd, self.rank, self.p, self.v, self.vshape)
            if nxt is not None:
                local[nxt[1]] = out
            else:
                dst = message_of(fwd, self.rank, self.p, self.v, self.vshape)[1]
                self.comm.wait_p2p(self.comm.batch_p2p([("send", out.to(self.dtype).contiguous(), dst)]))
        return loss

    # -- measured timeline ----------------------------------------------------------------------
    @property
    def last_times(self) -> list[tuple[float, float]]:
        """Wall-clock (start, end) of every item of the last training step (on CUDA this waits for
        the step's kernels, so it is read at logged steps only)."""
        return self._clock.spans() if self._clock is not None else []

    def record(self, path: str | None, step: int) -> float:
        """Gather the last step's timeline over the pp group (a collective: every rank calls it);
        write the Chrome trace to `path` when given. Returns the measured bubble fraction."""
        from ....core.schedule import trace

        counts = [len(p2p_batches(acts)) for acts in self.actions]
        spans = gather_spans(self.comm, self.last_times, counts)
        bubble = trace.measured_bubble(self.actions, spans)
        if path is not None:
            meta = {"schedule": self.schedule, "p": self.p, "m": self.m, "v": self.v, "step": step,
                    "bubble": bubble, "vshape": self.vshape}
            trace.write_chrome_trace(path, self.actions, spans, meta)
        return bubble


class _Clock:
    """Wall-clock spans of the items of one step. On CUDA the spans come from events on the compute
    stream (host time says nothing about when kernels ran), anchored to the wall clock once per step
    by draining that stream (only it: collectives in flight on other streams keep overlapping)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        if self.cuda:
            torch.cuda.current_stream(device).synchronize()
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        self.wall0, self.t0 = time.time(), time.perf_counter()

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.marks.append([self._now(), None])

    def stop(self) -> None:
        self.marks[-1][1] = self._now()

    def spans(self) -> list[tuple[float, float]]:
        if self.cuda:
            if self.marks:
                self.marks[-1][1].synchronize()
            rel = [(self.origin.elapsed_time(a) / 1e3, self.origin.elapsed_time(b) / 1e3) for a, b in self.marks]
        else:
            rel = [(a - self.t0, b - self.t0) for a, b in self.marks]
        return [(self.wall0 + a, self.wall0 + b) for a, b in rel]


def gather_spans(comm, mine: list[tuple[float, float]], counts: list[int]) -> list[list[tuple[float, float]]]:
    """Every pp rank's item spans (rank order), from this rank's `mine`; `counts` items per rank."""
    n = max(counts)
    local = torch.zeros(n, 2, dtype=torch.float64)
    if mine:
        local[:len(mine)] = torch.tensor(mine, dtype=torch.float64)
    out = torch.empty(comm.size * n, 2, dtype=torch.float64)
    comm.all_gather(out, local)
    rows = out.view(comm.size, n, 2).tolist()
    return [[tuple(x) for x in rows[r][:counts[r]]] for r in range(comm.size)]
