"""DiLoCo's outer step between island jobs (training.outer.on_island_loss = "continue"; docs/diloco.md,
"Losing an island"): the same outer step as `OuterSync` (islands.py), run as rounds over the link
(distributed/link.py), so that the islands that are there average without the ones that are not, and an
island that (re)starts is brought up to the others' state before it trains.

A round opens with a header from every member (island, step, whether it is in an outer sync or starting,
the fragment due). The *donor* is the member in a sync (else the one furthest on), at the highest step,
lowest island first. Members in the same sync at the donor's step send their Δ; the others send zeros and
are not counted in the mean. Members that are starting, or behind the donor, are *healed*: they receive
the donor's whole state (θ_outer and its momentum, the masters and the inner optimizer's moments, model
buffers, the step and data position), then take the same outer step, so they leave the round equal to the
donor. Everything is applied when the link commits the round; nothing before.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from ...distributed.link import Link, RunOver

HEADER = 4  # island, step, in a sync (1) or starting (0), fragment due (-1: none)


class LinkedRounds:
    """The rounds of one island job. It is made before the `OuterSync` that owns it (islands.py), which
    hands itself to each round (`sync(outer, ...)`): neither object points back at the other. The
    trainer's state comes with `start`: `position()` / `set_position(meta)`, the step, data position and
    the like as JSON-able values (train/state.py); `buffers()`, model state outside the optimizer (the
    MoE balancing bias)."""

    def __init__(self, link: Link, island: int):
        self.link, self.island = link, island
        self.position = self.set_position = self.buffers = None  # the trainer's state, from `start`
        self.healed = 0  # rounds in which this island received a donor's state

    def start(self, outer, state, step: int) -> list[int]:
        """Meet the other islands before training: a restarted island waits for their next sync and
        leaves it with their state; at a launch, islands resumed from different steps agree."""
        self.position, self.set_position, self.buffers = state.position, state.set_position, state.par.model_state
        return self.link.run(lambda comm: self._round(comm, outer, step, None))

    def sync(self, outer, f: int, step: int) -> list[int]:
        return self.link.run(lambda comm: self._round(comm, outer, step, f))

    def _round(self, comm, outer, step: int, f: int | None) -> Callable[[], None]:
        dev = outer.device
        head = torch.tensor([self.island, step, int(f is not None), -1 if f is None else f], dtype=torch.int64)
        heads = torch.empty(comm.size * HEADER, dtype=torch.int64)
        comm.all_gather(heads, head, kind="outer_header")
        rows = heads.view(comm.size, HEADER).tolist()
        donor = max(range(len(rows)), key=lambda i: (rows[i][2], rows[i][1], -rows[i][0]))
        _, d_step, d_live, d_frag = rows[donor]
        sends = [r[2] == 1 and r[1] == d_step and d_live == 1 for r in rows]
        heal = [i != donor and not sends[i] and (d_live == 1 or r[1] < d_step) for i, r in enumerate(rows)]
        me = comm.rank
        mean = None
        if d_live:
            delta = outer.delta(d_frag) if sends[me] else torch.zeros(outer.size(d_frag), device=dev)
            mean = outer.average(comm, delta, count=sum(sends))
        state = self._receive(comm, outer, donor) if any(heal) else None

        def commit() -> None:
            if heal[me]:
                self._install(outer, *state)
                self.healed += 1
            if mean is not None:
                outer.apply(d_frag, mean)
            if heal[me] or mean is not None:
                opt = outer.optimizer
                opt.loaded(opt.step_count())  # the new masters reach the parameters
        return commit

    # -- healing ------------------------------------------------------------------------------
    def _tensors(self, outer) -> list[torch.Tensor]:
        """Everything a healed island takes from the donor, in one order on every member."""
        out = [t for _, _, t in outer.optimizer.state_storage()]
        out += list(self.buffers().values())
        out += [d[name] for d in (outer.params, outer.momentum) for name in sorted(d)]
        return out

    def _receive(self, comm, outer, donor: int) -> tuple[torch.Tensor, dict]:
        """The donor's state, broadcast flat (fp32) with its position as JSON."""
        tensors, dev = self._tensors(outer), outer.device
        if comm.rank == donor:
            flat = torch.cat([t.detach().float().reshape(-1).to(dev) for t in tensors])
            text = torch.tensor(list(json.dumps(self.position()).encode()), dtype=torch.uint8)
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), device=dev)
            text = None
        size = torch.tensor([0 if text is None else text.numel()], dtype=torch.int64)
        comm.broadcast(size, donor)
        text = text if text is not None else torch.empty(int(size), dtype=torch.uint8)
        comm.broadcast(text, donor)
        comm.broadcast(flat, donor)
        return flat, json.loads(bytes(text.tolist()).decode())

    @torch.no_grad()
    def _install(self, outer, flat: torch.Tensor, meta: dict) -> None:
        at = 0
        for t in self._tensors(outer):
            t.copy_(flat[at:at + t.numel()].view(t.shape).to(t.device, t.dtype))
            at += t.numel()
        self.set_position(meta)


def linked(ctx, timeout_s: float) -> LinkedRounds:
    """The rounds of this rank's island job over the launcher's store (train/island_jobs.py)."""
    from ...distributed.link import connect
    island = ctx.coords["islands"]
    return LinkedRounds(Link(connect(timeout_s), island, ctx.job_rank, timeout_s, ctx.comm("islands")), island)


def meet_islands(rounds: LinkedRounds, outer, ctx, state, steps: int) -> None:
    """Island jobs (docs/diloco.md, "Losing an island"): the first round with the other islands, before
    any step; an island that took a donor's state says so. An island that came back after the others
    finished has its `state.step` set to `steps` (its run is over too)."""
    before = state.step
    try:
        rounds.start(outer, state, before)
    except RunOver as e:
        print(f"meshlm: {e}", file=sys.stderr, flush=True)
        state.step = steps  # fit has nothing left to run
        return
    if rounds.healed and ctx.job_rank == 0:
        print(f"meshlm: island {ctx.coords['islands']} rejoined at step {state.step} (it was at step "
              f"{before}) with the other islands' state", file=sys.stderr, flush=True)
