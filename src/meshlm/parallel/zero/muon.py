"""Muon over ZeRO's shards (zero 1-3, HSDP): each matrix orthogonalised whole by one owner.

A rank holds a flat range of each parameter of a unit (`Unit.pieces`, units.py). Momentum and the
Nesterov update are elementwise, so they run on those ranges; Newton-Schulz needs the whole matrix.
The matrices of the shard group are dealt round-robin over its ranks (Moonlight's distributed Muon):
the unit's updates are all-gathered over the shard group, each rank orthogonalises the matrices it
owns (gathering their TP slices over tp first, where split: its TP peers own the same matrices), and
a reduce-scatter of the results, zero outside each owner's matrices, returns every rank its range.
Adding zeros is exact, so every layout applies one process's update. Both collectives go through the
unit's `Comm` and are counted there. The fp32 masters are ZeroOptimizer's (`slots`), which publishes
them after its own step; Muon's parameters are left out of its AdamW runs (`skip`).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...config import OptimConfig
from ..muon import Orthogonaliser, nesterov_
from ..placement import PlacementTable
from .optim import ZeroOptimizer


class ZeroMuon:
    """Muon's part of `muon.MuonAdamW` under ZeRO. `names`/`params` are empty: ZeroOptimizer already
    lists every parameter of every unit."""

    names: list[str] = []
    params: list = []

    def __init__(self, zero_opt: ZeroOptimizer, muon: set[str], table: PlacementTable, comm_of: Callable,
                 cfg: OptimConfig):
        self.zero_opt = zero_opt
        # per unit holding Muon parameters: (unit, master, [(segment, name, momentum, owned, orthogonaliser)])
        self.units = []
        k = 0
        for u, master, *_ in zero_opt.slots:
            rows = []
            for seg, name in zip(u.pieces, u.names):
                if name not in muon:
                    continue
                owned = k % u.comm.size == u.comm.rank
                ortho = Orthogonaliser(u.shapes[seg.param], table[name], comm_of, cfg.muon_ns_steps) if owned else None
                rows.append((seg, name, torch.zeros(seg.end - seg.start, device=master.device), ortho))
                k += 1
            if rows:
                self.units.append((u, master, rows))

    @torch.no_grad()
    def step(self, lr: float, cfg: OptimConfig) -> None:
        for u, master, rows in self.units:
            grad = u.grad_shard
            update = torch.zeros(u.shard_size, dtype=torch.float32, device=master.device)
            for seg, _, mom, _ in rows:
                update[seg.start:seg.end] = nesterov_(mom, grad[seg.start:seg.end], cfg.muon_momentum)
            whole = torch.empty(u.padded, dtype=torch.float32, device=master.device)
            u.comm.all_gather(whole, update)
            mine = torch.zeros_like(whole)  # the owner's results, zero elsewhere
            for seg, _, _, ortho in rows:
                if ortho is not None:
                    u.view(mine, seg.param).copy_(ortho(u.view(whole, seg.param)))
            ours = torch.empty(u.shard_size, dtype=torch.float32, device=master.device)
            u.comm.reduce_scatter(ours, mine)
            for seg, *_ in rows:
                piece = master[seg.start:seg.end]
                piece.mul_(1.0 - lr * cfg.weight_decay).add_(ours[seg.start:seg.end], alpha=-lr)

    def publish(self) -> None:
        pass  # ZeroOptimizer publishes every master after its step and on load

    def storage(self) -> list[tuple[str, str, torch.Tensor]]:
        return [(name, kind, t) for u, master, rows in self.units for seg, name, mom, _ in rows
                for kind, t in (("master", master[seg.start:seg.end]), ("momentum", mom))]

    def param_tensors(self) -> list[torch.Tensor]:
        return []  # ZeroOptimizer's

    def own_tensors(self) -> list[torch.Tensor]:
        return [mom for *_, rows in self.units for _, _, mom, _ in rows]
