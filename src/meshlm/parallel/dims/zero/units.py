"""ZeRO units: parameters gathered, reduced and stepped together, in one flat buffer.

A unit's parameters lie back to back in one flat buffer padded to a multiple of its shard group's size N,
and rank r owns the contiguous slice [r·S, (r+1)·S) of it. Gathers and reductions are then one
zero-copy collective per unit, while `Unit.pieces` (this rank's `Segment` of each parameter) keeps
everything expressible per parameter: weight decay per tensor, the placement records (a flat range
of each parameter) and so sharded checkpoints. Which parameters form a unit is the model plan's call
(parallel/model_plans/llama.py); how its gradient is reduced is the unit's `Reduction`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ....distributed.comm import Comm, Handle
from ..grad_sync import Reduction, decays

SHARDED, GATHERING, GATHERED = 0, 1, 2


class Segment(NamedTuple):
    """This rank's piece of one parameter of a unit: elements [start, end) of the unit's shard, which
    are the flattened parameter's elements [param_start, param_end). Empty (start == end) where the
    rank holds none of it. Computed once, in `Unit`; the optimizers, the gradient synchroniser and the
    placement record (`FlatRange`, parallel/placement.py) all read it from there."""
    param: int  # index into Unit.params / Unit.names
    start: int
    end: int
    param_start: int

    @property
    def param_end(self) -> int:
        return self.param_start + self.end - self.start


class Unit:
    """Parameters gathered, reduced and stepped together; `first`/`last` are the modules whose forward
    starts and ends the unit's use."""

    def __init__(self, name: str, params: list[nn.Parameter], names: list[str], first: nn.Module,
                 last: nn.Module, reduction: Reduction):
        self.name, self.params, self.names, self.first, self.last = name, params, names, first, last
        self.reduction = reduction
        self.comm: Comm = reduction.scatter  # parameters are sharded, gathered and reduce-scattered over it
        n, rank = self.comm.size, self.comm.rank
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
        self.pieces: list[Segment] = [self.piece(i, rank) for i in range(len(params))]  # one per parameter
        self.next_fwd: Unit | None = None  # prefetch targets
        self.next_bwd: Unit | None = None
        self.keep_after_forward = False
        self.full: torch.Tensor | None = None  # the flat parameters (storage freed while sharded)
        self.shard: torch.Tensor | None = None  # this rank's slice, compute dtype
        self.state = SHARDED
        self.handle: Handle | None = None
        self.grad_full: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []  # per-parameter views of grad_full
        self.unfilled: set[int] = set(range(len(params)))  # parameters whose view holds no gradient yet
        self.grad_shard: torch.Tensor | None = None  # fp32, what the optimizer reads (zero 2-3: per step)
        self.pending = len(params)
        self.in_backward = False
        self.reduced = False

    def piece(self, i: int, rank: int) -> Segment:
        """Rank `rank`'s Segment of parameter i, in the terms of that rank's shard (Muon's owners read
        the other ranks' pieces of their matrices)."""
        lo, o, k = rank * self.shard_size, self.offsets[i], self.numels[i]
        a, b = max(o, lo), min(o + k, lo + self.shard_size)
        return Segment(i, a - lo, b - lo, a - o) if a < b else Segment(i, 0, 0, 0)

    @property
    def segments(self) -> list[Segment]:
        """The pieces this rank holds something of."""
        return [s for s in self.pieces if s.start < s.end]

    def decay_runs(self, skip: frozenset[str] = frozenset()) -> list[tuple[bool, int, int]]:
        """(weight decay?, start, end) in shard terms: this rank's pieces, neighbours with the same
        `grad_sync.decays` merged into one run over the alignment padding between them, which is zero in
        masters, moments and gradients and stays zero under AdamW. The optimizers step runs, not
        pieces: a handful per unit, whatever the number of parameters. `skip`: parameters another
        optimizer steps (optim.name = "muon"), left out and never merged over."""
        runs: list[tuple[bool, int, int]] = []
        cut = False
        for seg in self.segments:
            if self.names[seg.param] in skip:
                cut = True
                continue
            d = decays(self.shapes[seg.param])
            if runs and runs[-1][0] == d and not cut:
                runs[-1] = (d, runs[-1][1], seg.end)
            else:
                runs.append((d, seg.start, seg.end))
            cut = False
        return runs

    @property
    def gaps(self) -> list[tuple[int, int]]:
        """[start, end) ranges of the flat buffer that no parameter covers (alignment, padding)."""
        ends = [o + k for o, k in zip(self.offsets, self.numels)]
        starts = self.offsets[1:] + [self.padded]
        return [(a, b) for a, b in zip(ends, starts) if a < b]

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        o = self.offsets[i]
        return flat[o:o + self.numels[i]].view(self.shapes[i])


def build_units(model: nn.Module, named: list[tuple[str, nn.Parameter]], plan, split_tied: bool,
                reduction_of) -> tuple[list[Unit], list[Unit]]:
    """Units in forward order of entry, and of exit (their reverse is the backward order), from the
    plan's unit specs. `reduction_of(name)`: the parameter's Reduction (one per unit)."""
    name_of = {id(p): name for name, p in named}
    taken: set[int] = set()
    made: dict[str, Unit] = {}

    def unit(spec) -> Unit | None:
        if spec.name in made:
            return made[spec.name]
        ps = []
        for m in spec.modules:
            if m is None:
                continue
            for p in m.parameters():
                if id(p) in name_of and id(p) not in taken:
                    taken.add(id(p))
                    ps.append(p)
        if not ps:
            return None
        names = [name_of[id(p)] for p in ps]
        reds = {reduction_of(n).key: reduction_of(n) for n in names}
        if len(reds) != 1:
            raise ValueError(f"ZeRO unit {spec.name}: parameters with different gradient reductions")
        made[spec.name] = Unit(spec.name, ps, names, spec.first, spec.last, next(iter(reds.values())))
        return made[spec.name]

    entry_specs, exit_specs = plan.zero_units(model, split_tied)
    for s in exit_specs:  # exit order takes parameters first: the catch-all `rest` comes last there
        unit(s)
    entry = [made[s.name] for s in entry_specs if s.name in made]
    exit_ = [made[s.name] for s in exit_specs if s.name in made]
    return entry, exit_
