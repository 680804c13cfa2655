"""Muon over ZeRO's shards (zero 1-3, HSDP): each matrix orthogonalised whole by one owner.

A rank holds a flat range of each parameter of a unit (`Unit.pieces`, units.py). Momentum and the
Nesterov update are elementwise, so they run on those ranges; Newton-Schulz needs the whole matrix.
The matrices of a stage are dealt over the shard group times tp (`muon.deal`: round-robin in order
of decreasing NS cost; slot s is shard rank s % n and tp rank s // n), so each is orthogonalised on
one rank of the world's n·tp that hold pieces of it. Per unit, one all-to-all over the shard group
(`muon.owner_exchange` on a `muon.Route` from `Unit.piece`) sends each shard owner exactly the pieces
of its matrices that the other ranks hold (a matrix may span several shards; the unit's alignment and
padding never travel); its TP peers own the same matrices, and where TP splits them one exchange over
tp (`muon.SplitExchange`) hands each to its tp owner, which orthogonalises it whole and returns the
slices; the mirrored all-to-all returns every rank the results for its pieces. All go through a
`Comm` (the unit's, tp's) and are counted there. The fp32 masters are ZeroOptimizer's (`slots`),
which publishes them after its own step; Muon's parameters are left out of its AdamW runs (`skip`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...core.config import OptimConfig
from ..dims.zero.units import Segment, Unit
from ..placement import PlacementTable
from .muon import Orthogonaliser, Route, SplitExchange, deal, nesterov_, owner_exchange, plan_route
from .zero_adamw import ZeroOptimizer


class Row(NamedTuple):
    """One Muon parameter of a unit on this rank: its piece, momentum, and where that piece sits in
    the buffer sent to the owners (`at`; the results come back to the same place)."""
    seg: Segment
    name: str
    momentum: torch.Tensor
    at: int


class Exchange(NamedTuple):
    """A unit's plan, the same every step: rows (this rank's pieces, in parameter order), the route to
    the owners over the shard group (items: the unit's Muon parameters in order), each item's
    Orthogonaliser, and the exchange over tp of this rank's owned matrices that TP splits (`tp`, with
    their items), where there are any."""
    unit: Unit
    master: torch.Tensor
    rows: list[Row]
    route: Route
    orthos: list[Orthogonaliser]
    tp: SplitExchange | None
    tp_items: list[int]


def plan_exchange(u: Unit, master: torch.Tensor, muon: list[int], slots: list[int], orthos: list[Orthogonaliser],
                  device) -> Exchange:
    """The plan of unit u whose Muon parameters `muon` (indices, in order) have the deal's `slots`:
    slot s is shard rank s % n and, for a matrix TP splits, tp rank s // n, so TP peers (which hold
    the same unit) own the same matrices and deal them over tp."""
    n, me = u.comm.size, u.comm.rank

    def size(k: int, r: int) -> int:
        seg = u.piece(muon[k], r)
        return seg.end - seg.start
    route = plan_route([s % n for s in slots], size, n, me)
    rows = [Row(seg, u.names[seg.param], torch.zeros(seg.end - seg.start, device=device), route.at[k])
            for k, seg in enumerate(u.pieces[i] for i in muon)]
    tp_items = [k for k, _ in route.owned if orthos[k].split]
    tp = SplitExchange([orthos[k] for k in tp_items], [slots[k] // n for k in tp_items]) if tp_items else None
    return Exchange(u, master, rows, route, orthos, tp, tp_items)


class ZeroMuon:
    """Muon's part of `muon.MuonAdamW` under ZeRO. `names`/`params` are empty: ZeroOptimizer already
    lists every parameter of every unit."""

    names: list[str] = []
    params: list = []

    def __init__(self, zero_opt: ZeroOptimizer, muon: set[str], table: PlacementTable, comm_of: Callable,
                 cfg: OptimConfig):
        self.zero_opt = zero_opt
        held = []  # (unit, master, Muon indices, their Orthogonalisers)
        for u, master, *_ in zero_opt.slots:
            idx = [i for i, name in enumerate(u.names) if name in muon]
            if idx:
                held.append((u, master, idx, [Orthogonaliser(u.shapes[i], table[u.names[i]], comm_of,
                                                             cfg.muon_ns_steps) for i in idx]))
        self.units: list[Exchange] = []
        for group in {id(u.comm): [h for h in held if h[0].comm is u.comm] for u, *_ in held}.values():
            orthos = [o for *_, os_ in group for o in os_]  # one deal over the shard group and tp, units in order
            tp = next((o.comm.size for o in orthos if o.split), 1)
            slots = iter(deal([o.flops for o in orthos], group[0][0].comm.size * tp))
            for u, master, idx, os_ in group:
                self.units.append(plan_exchange(u, master, idx, [next(slots) for _ in idx], os_, master.device))

    def _work(self, x: Exchange, items: list[int], pieces: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The owned matrices (this rank's tp slices, joined from the shard group's pieces) orthogonalised:
        those TP splits through one exchange over tp, the others here."""
        whole = {k: torch.cat(p) for k, p in zip(items, pieces)}
        if x.tp is not None:  # one bucket: a unit's owned matrices
            def take(j: int, v: torch.Tensor) -> None:
                whole[x.tp_items[j]] = v
            x.tp.run(lambda j, v: v.copy_(whole[x.tp_items[j]]), take, x.master.device)
        return [whole[k] if x.orthos[k].split else x.orthos[k](whole[k].view(x.orthos[k].local_shape)).reshape(-1)
                for k in items]

    @torch.no_grad()
    def step(self, lr: float, cfg: OptimConfig) -> None:
        for x in self.units:
            u, grad = x.unit, x.unit.grad_shard
            out = torch.empty(sum(x.route.send), dtype=torch.float32, device=x.master.device)
            for seg, _, mom, at in x.rows:
                nesterov_(mom, grad[seg.start:seg.end], cfg.muon_momentum, out=out[at:at + seg.end - seg.start])
            owner_exchange(u.comm, x.route, out, lambda items, pieces, x=x: self._work(x, items, pieces))
            for seg, _, _, at in x.rows:
                piece = x.master[seg.start:seg.end]
                piece.mul_(1.0 - lr * cfg.weight_decay).add_(out[at:at + seg.end - seg.start], alpha=-lr)

    def orthogonalisers(self) -> list[tuple[str, Orthogonaliser]]:
        """Every Muon matrix's Orthogonaliser (their `runs`: the Newton-Schulz calls on this rank)."""
        return [(row.name, o) for x in self.units for row, o in zip(x.rows, x.orthos, strict=True)]

    def publish(self) -> None:
        pass  # ZeroOptimizer publishes every master after its step and on load

    def storage(self) -> list[tuple[str, str, torch.Tensor]]:
        return [(row.name, kind, t) for x in self.units for row in x.rows
                for kind, t in (("master", x.master[row.seg.start:row.seg.end]), ("momentum", row.momentum))]

    def param_tensors(self) -> list[torch.Tensor]:
        return []  # ZeroOptimizer's

    def own_tensors(self) -> list[torch.Tensor]:
        return [row.momentum for x in self.units for row in x.rows]
