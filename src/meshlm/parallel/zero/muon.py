"""Muon over ZeRO's shards (zero 1-3, HSDP): each matrix orthogonalised whole by one owner.

A rank holds a flat range of each parameter of a unit (`Unit.pieces`, units.py). Momentum and the
Nesterov update are elementwise, so they run on those ranges; Newton-Schulz needs the whole matrix.
The matrices of the shard group are dealt round-robin over its ranks (Moonlight's distributed Muon).
One all-to-all over the shard group sends each owner exactly the pieces of its matrices that the other
ranks hold (a matrix may span several shards; the unit's alignment and padding never travel); the
owner orthogonalises them whole (gathering their TP slices over tp first, where split: its TP peers own
the same matrices), and a second all-to-all with the mirrored splits returns every rank the results
for its pieces. Each rank sends its shard of the Muon matrices and receives its owned matrices, then
the reverse. Both go through the unit's `Comm` and are counted there. The fp32 masters are
ZeroOptimizer's (`slots`), which publishes them after its own step; Muon's parameters are left out of
its AdamW runs (`skip`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...config import OptimConfig
from ..muon import Orthogonaliser, nesterov_
from ..placement import PlacementTable
from .optim import ZeroOptimizer
from .units import Segment, Unit


class Row(NamedTuple):
    """One Muon parameter of a unit on this rank: its piece, momentum, and where that piece sits in
    the buffer sent to the owners (`at`; the results come back to the same place)."""
    seg: Segment
    name: str
    momentum: torch.Tensor
    at: int


class Owned(NamedTuple):
    """A matrix this rank orthogonalises: its parameter index, and the (offset, length) of each rank's
    piece of it in the received buffer, in rank order (their concatenation is the flat matrix)."""
    param: int
    pieces: list[tuple[int, int]]
    ortho: Orthogonaliser


class Exchange(NamedTuple):
    """A unit's split plan, the same every step: rows (this rank's pieces, in parameter order), the
    matrices it owns, and the all-to-all splits (send: this rank's pieces per owner; receive: every
    rank's pieces of this rank's matrices)."""
    unit: Unit
    master: torch.Tensor
    rows: list[Row]
    owned: list[Owned]
    send: list[int]
    recv: list[int]


def plan_exchange(u: Unit, master: torch.Tensor, muon: list[int], owners: list[int], make_ortho: Callable,
                  device) -> Exchange:
    """The split plan of unit u whose Muon parameters `muon` (indices, in order) are owned by `owners`."""
    n, me = u.comm.size, u.comm.rank
    send, at, pos = [0] * n, 0, {}
    for k in sorted(range(len(muon)), key=lambda k: (owners[k], k)):  # send buffer: by owner, then parameter
        seg = u.pieces[muon[k]]
        pos[k] = at
        send[owners[k]] += seg.end - seg.start
        at += seg.end - seg.start
    rows = [Row(seg, u.names[seg.param], torch.zeros(seg.end - seg.start, device=device), pos[k])
            for k, seg in enumerate(u.pieces[i] for i in muon)]
    mine = [i for i, o in zip(muon, owners) if o == me]
    recv, pieces, at = [0] * n, {i: [] for i in mine}, 0
    for r in range(n):  # received buffer: by sender, then parameter, as each sender ordered it
        for i in mine:
            seg = u.piece(i, r)
            if size := seg.end - seg.start:
                pieces[i].append((at, size))
                recv[r] += size
                at += size
    owned = [Owned(i, pieces[i], make_ortho(u.shapes[i], u.names[i])) for i in mine]
    return Exchange(u, master, rows, owned, send, recv)


class ZeroMuon:
    """Muon's part of `muon.MuonAdamW` under ZeRO. `names`/`params` are empty: ZeroOptimizer already
    lists every parameter of every unit."""

    names: list[str] = []
    params: list = []

    def __init__(self, zero_opt: ZeroOptimizer, muon: set[str], table: PlacementTable, comm_of: Callable,
                 cfg: OptimConfig):
        self.zero_opt = zero_opt

        def make_ortho(shape, name):
            return Orthogonaliser(shape, table[name], comm_of, cfg.muon_ns_steps)

        self.units: list[Exchange] = []
        k = 0  # the round-robin deal runs on over the units
        for u, master, *_ in zero_opt.slots:
            idx = [i for i, name in enumerate(u.names) if name in muon]
            if idx:
                owners = [(k + j) % u.comm.size for j in range(len(idx))]
                self.units.append(plan_exchange(u, master, idx, owners, make_ortho, master.device))
                k += len(idx)

    @torch.no_grad()
    def step(self, lr: float, cfg: OptimConfig) -> None:
        for x in self.units:
            u, grad = x.unit, x.unit.grad_shard
            out = torch.empty(sum(x.send), dtype=torch.float32, device=x.master.device)
            for seg, _, mom, at in x.rows:
                nesterov_(mom, grad[seg.start:seg.end], cfg.muon_momentum, out=out[at:at + seg.end - seg.start])
            got = torch.empty(sum(x.recv), dtype=torch.float32, device=x.master.device)
            u.comm.all_to_all(got, out, x.recv, x.send)
            for i, pieces, ortho in x.owned:
                whole = torch.cat([got[a:a + n] for a, n in pieces]).view(u.shapes[i])
                result, p = ortho(whole).reshape(-1), 0
                for a, n in pieces:  # the results go back where the pieces came from
                    got[a:a + n] = result[p:p + n]
                    p += n
            u.comm.all_to_all(out, got, x.send, x.recv)
            for seg, _, _, at in x.rows:
                piece = x.master[seg.start:seg.end]
                piece.mul_(1.0 - lr * cfg.weight_decay).add_(out[at:at + seg.end - seg.start], alpha=-lr)

    def publish(self) -> None:
        pass  # ZeroOptimizer publishes every master after its step and on load

    def storage(self) -> list[tuple[str, str, torch.Tensor]]:
        return [(row.name, kind, t) for x in self.units for row in x.rows
                for kind, t in (("master", x.master[row.seg.start:row.seg.end]), ("momentum", row.momentum))]

    def param_tensors(self) -> list[torch.Tensor]:
        return []  # ZeroOptimizer's

    def own_tensors(self) -> list[torch.Tensor]:
        return [row.momentum for x in self.units for row in x.rows]
