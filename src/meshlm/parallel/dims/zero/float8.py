"""ZeRO-3 weight gathers in float8 (training.fp8_comm "zero", docs/fp8.md): `ZeroSync` (sync.py) gathers
a unit holding weights that multiply in float8 (the blocks' Float8Linear weights, tensorwise recipe)
through here.

1. Scales first: the amax of each float8 weight's piece of this rank's shard, all-reduced (MAX) over
   the shard group, one small collective per unit and gather. Every rank then holds the scale
   torchao's GEMM computes from the whole weight, so each casts its piece exactly as the whole weight
   would be cast and the gathered codes are that cast bit for bit. Dynamic, not delayed, scaling: the
   scale is the current weight's, as the GEMM's own cast is, so a run gathering float8 computes what
   one gathering bf16 does (and its losses are those); a delayed scale (an amax history) would save
   only this one few-byte all-reduce and would make the gather a second, different quantisation.
2. The shard cast with those scales into one byte per element, in place (byte k is element k; the
   bytes of the unit's other parameters are unused), all-gathered as uint8 into `full8`: each float8
   weight is then a view of it that the GEMM takes without re-casting (features/float8_comm.py).
3. The unit's other parameters (the norms) all-gathered in the compute dtype, as rows of the longest
   rank's share, into a small buffer of their own that those parameters view.
Such a unit never allocates its flat bf16 buffer: its float8 weights' bf16 views are never read (the
GEMM takes the float8 ones, and their gradients reach the parameters through autograd as before).
Gradients are reduce-scattered as for any unit; masters stay fp32 in the optimizer.
"""
from __future__ import annotations

import torch

from ....distributed.comm import Handle
from ....distributed.float8_comm import amax, decode, encode, shared_scales
from ....model.ops import eager_under_compile
from .units import Unit


class _UnitPlan:
    """Which parameters of a unit go as float8, and where every rank's share of the others lies."""

    def __init__(self, u: Unit, float8: set[int], dtype: torch.dtype):
        self.f8 = [i for i, p in enumerate(u.params) if id(p) in float8]
        self.hp = [i for i in range(len(u.params)) if i not in self.f8]
        # rank r's share of the other parameters: (param, shard start, shard end, param start) in order
        self.shares = [[u.piece(i, r) for i in self.hp if u.piece(i, r).start < u.piece(i, r).end]
                       for r in range(u.comm.size)]
        self.width = max([sum(s.end - s.start for s in share) for share in self.shares] + [0])
        self.offsets, off = {}, 0
        for i in self.hp:
            self.offsets[i], off = off, off + u.numels[i]
        self.full8 = torch.empty(u.padded, dtype=torch.uint8, device=u.device)
        self.codes = {i: _alias(self.full8, u.offsets[i], u.shapes[i], dtype) for i in self.f8}
        self.full8.untyped_storage().resize_(0)
        self.hp_full = torch.empty(off, dtype=u.dtype, device=u.device)
        self.scales: torch.Tensor | None = None  # this gather's, one per float8 weight


class Float8Gather:
    """The float8 gathers of the units that hold any of `float8` (parameter ids); `dtype`: the
    weights' float8 dtype (torchao's config: e4m3)."""

    def __init__(self, units: list[Unit], float8: set[int], dtype: torch.dtype):
        self.dtype = dtype
        self.plans = {id(u): _UnitPlan(u, float8, dtype) for u in units if any(id(p) in float8 for p in u.params)}
        self.where = {id(u.params[i]): (u, j) for u in units if id(u) in self.plans
                      for j, i in enumerate(self.plans[id(u)].f8)}

    def covers(self, u: Unit) -> bool:
        return id(u) in self.plans

    def seat(self, u: Unit) -> None:
        """The unit's other parameters view their own buffer (before its flat buffer is freed for good)."""
        g = self.plans[id(u)]
        for i in g.hp:
            u.params[i].data = g.hp_full[g.offsets[i]:g.offsets[i] + u.numels[i]].view(u.shapes[i])
        g.hp_full.untyped_storage().resize_(0)

    def gather(self, u: Unit) -> Handle:
        """Start the unit's gather (scales, float8 codes, the other parameters); the handle's wait
        finishes it."""
        g, shard = self.plans[id(u)], u.shard
        pieces = [u.pieces[i] for i in g.f8]
        g.scales = shared_scales(torch.stack([amax(shard[s.start:s.end]) for s in pieces]), u.comm, self.dtype)
        mine = torch.empty(u.shard_size, dtype=torch.uint8, device=u.device)
        for j, s in enumerate(pieces):
            if s.start < s.end:
                encode(shard[s.start:s.end], g.scales[j], self.dtype, out=mine[s.start:s.end])
        g.full8.untyped_storage().resize_(u.padded)
        rest = self._gather_rest(u, g) if g.width else None
        h = u.comm.all_gather(g.full8, mine, async_op=True)
        h.after = rest
        return h

    def _gather_rest(self, u: Unit, g: _UnitPlan):
        """Start gathering the non-float8 parameters; returns what finishes it."""
        n, w = u.comm.size, g.width
        send = torch.zeros(w, dtype=u.dtype, device=u.device)
        at = 0
        for s in g.shares[u.comm.rank]:
            send[at:at + s.end - s.start].copy_(u.shard[s.start:s.end])
            at += s.end - s.start
        rows = torch.empty(n * w, dtype=u.dtype, device=u.device)
        h = u.comm.all_gather(rows, send, async_op=True)

        def finish() -> None:
            h.wait()
            g.hp_full.untyped_storage().resize_(g.hp_full.numel() * g.hp_full.element_size())
            for r, share in enumerate(g.shares):
                at = r * w
                for s in share:
                    k = s.end - s.start
                    o = g.offsets[s.param] + s.param_start
                    g.hp_full[o:o + k].copy_(rows[at:at + k])
                    at += k
        return finish

    def release(self, u: Unit) -> None:
        g = self.plans[id(u)]
        g.full8.untyped_storage().resize_(0)
        g.hp_full.untyped_storage().resize_(0)

    @eager_under_compile  # a compiled block asks for the weight eagerly: the unit's buffers change each gather
    def weight(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered float8 codes of parameter `p` (its shape, in the unit's buffer) and its scale; only
        while its unit is gathered (ZeRO-3 gathers it before every forward and backward)."""
        u, j = self.where[id(p)]
        g = self.plans[id(u)]
        return g.codes[g.f8[j]], g.scales[j]


def _alias(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`buf[offset:offset + numel]` viewed as `shape` in `dtype`, as a tensor with a version counter of its
    own (as the parameters' `.data` views of a flat buffer are): each gather writes `buf` in place, and
    autograd (a compiled backward above all) would take that for a change of the codes the forward saved."""
    n = 1
    for d in shape:
        n *= d
    out = torch.empty(0, dtype=torch.uint8, device=buf.device)
    out.set_(buf.untyped_storage(), buf.storage_offset() + offset, (n,))
    return out.view(dtype).view(shape)
