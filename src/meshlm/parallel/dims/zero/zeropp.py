"""ZeRO++ on zero = 3 (docs/zero.md "ZeRO++"): the unit gathers and gradient reductions of `ZeroSync` (sync.py)
call in here when any of the three is on.

- qwZ (`quantize_weights`): a gather over the whole shard group moves each rank's shard as blockwise
  int8 (quantize.py); every rank, the owner included, computes with the dequantised values, so all
  ranks hold the same weights.
- hpZ (`hpz_group` = K): the first gather of a unit in a step with autograd on also keeps this rank's
  1/K of the full unit (a secondary shard over the K ranks of its group, `zpp_intra`). Every later
  gather of the unit in that step, backward's above all, is an all-gather inside the group, in the
  compute dtype: exact, the very values the first gather produced. The copies go when the parameters
  change (after the optimizer step) and at the start of a step.
- qgZ (`quantize_grads`): the unit's reduce-scatter becomes quantise → all-to-all inside the group →
  dequantise, sum in fp32 → quantise → all-to-all across groups (`zpp_inter`) → dequantise, sum in
  fp32; the result is this rank's slice of the summed gradient, as the reduce-scatter's would be.
Groups are the mesh's `zpp_intra` / `zpp_inter` (distributed/mesh.py: K consecutive ranks of the shard
group stand for a node); the bytes each moves are booked under kinds of their own (docs/zero.md).
"""
from __future__ import annotations

import torch

from ....distributed.comm import Comm, Handle
from .quantize import dequantize_rows, packed_bytes, quantize_rows
from .units import Unit


class ZeroPP:
    def __init__(self, intra: Comm, inter: Comm, quantize_weights: bool, hpz: bool, quantize_grads: bool):
        self.intra, self.inter = intra, inter
        self.quantize_weights, self.hpz, self.quantize_grads = quantize_weights, hpz, quantize_grads
        self.secondary: dict[int, torch.Tensor] = {}  # id(unit) -> this rank's 1/K of its full parameters

    @classmethod
    def for_job(cls, ctx, p) -> "ZeroPP | None":
        """From the mesh's groups and the parallel config; None when ZeRO++ is off."""
        if "zpp_intra" not in ctx.comms:
            return None
        return cls(ctx.comm("zpp_intra"), ctx.comm("zpp_inter"), p.quantize_weights, p.hpz_group > 0,
                   p.quantize_grads)

    def drop(self) -> None:
        self.secondary.clear()

    # -- gathers (zero 3: forward, backward, recomputation) ----------------------------------------
    def gather(self, u: Unit) -> Handle:
        """Start filling `u.full` (its storage already allocated); the handle's wait finishes it."""
        sec = self.secondary.get(id(u))
        if sec is not None:
            return self.intra.all_gather(u.full, sec, async_op=True, kind="all_gather_hpz")
        keep = self.hpz and torch.is_grad_enabled()
        if not self.quantize_weights:
            h = u.comm.all_gather(u.full, u.shard, async_op=True)
            h.after = (lambda: self._keep(u)) if keep else None
            return h
        n, s = u.comm.size, u.shard_size
        pb = packed_bytes(s)
        mine = torch.empty(1, pb, dtype=torch.uint8, device=u.device)
        quantize_rows(u.shard.view(1, s), mine)
        packed = torch.empty(n, pb, dtype=torch.uint8, device=u.device)
        h = u.comm.all_gather(packed.view(-1), mine.view(-1), async_op=True)

        def unpack() -> None:
            u.full.view(n, s).copy_(dequantize_rows(packed, s))
            if keep:
                self._keep(u)
        h.after = unpack
        return h

    def _keep(self, u: Unit) -> None:
        k, j = self.intra.size, self.intra.rank
        part = u.padded // k
        self.secondary[id(u)] = u.full[j * part:(j + 1) * part].clone()

    # -- gradient reduction (qgZ) --------------------------------------------------------------
    def reduce_scatter(self, u: Unit, out: torch.Tensor, full: torch.Tensor) -> Handle:
        """out <- this rank's slice of the sum of every shard-group rank's `full`, two-level, in int8."""
        k, m, s = self.intra.size, self.inter.size, u.shard_size
        # rank g·K + j of the shard group owns slice g·K + j: row j' of `rows` holds the slices owned by
        # the ranks at place j' of every group, which is what member j' of this group sums first
        rows = full.view(m, k, s).transpose(0, 1).reshape(k, m * s)
        part = self._exchange(self.intra, rows, "all_to_all_intra").view(m, s) if k > 1 else rows[0].float().view(m, s)
        total = self._exchange(self.inter, part, "all_to_all_inter") if m > 1 else part[0]
        out.copy_(total)
        return Handle(u.comm, "all_to_all_inter", None)

    @staticmethod
    def _exchange(comm: Comm, rows: torch.Tensor, kind: str) -> torch.Tensor:
        """Row i goes to member i in int8; what arrives is dequantised and summed in fp32."""
        n = rows.shape[1]
        send = torch.empty(rows.shape[0], packed_bytes(n), dtype=torch.uint8, device=rows.device)
        quantize_rows(rows, send)
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send, kind=kind)
        return dequantize_rows(recv, n).sum(0)
