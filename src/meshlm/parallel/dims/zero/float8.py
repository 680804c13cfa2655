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
The routed experts' stacked weights (w [E, out, in], `experts`) go as float8 too, with the row-wise scales
of their grouped GEMMs (model/fp8_grouped.py): a forward gather casts each with one scale per (expert,
output row), the input gradient's contraction, a backward gather with one per (expert, input column).
Each rank's partial maxima of the rows (columns) its flat piece touches join the amaxes of step 1
(the same one all-reduce), so every rank casts its piece with the whole row's (column's) scale, and
`Float8Gemms` takes the gathered codes as the ones it would have cast (`expert_weight`). A unit gathered
in one orientation and asked for the other (kept gathered into backward; a forward recomputed in
backward) is gathered again in the one asked for.
Such a unit never allocates its flat bf16 buffer: its float8 weights' bf16 views are never read (the
GEMM takes the float8 ones, and their gradients reach the parameters through autograd as before).
Gradients are reduce-scattered as for any unit; masters stay fp32 in the optimizer.
"""
from __future__ import annotations

import torch

from ....distributed.comm import Handle
from ....distributed.float8_comm import amax, encode, scales_of, shared_amax
from ....model.fp8_grouped import E4M3, pow2_scales
from ....model.ops import eager_under_compile
from .units import Segment, Unit


class _UnitPlan:
    """Which parameters of a unit go as float8, and where every rank's share of the others lies."""

    def __init__(self, u: Unit, float8: set[int], dtype: torch.dtype, experts: set[int]):
        self.f8 = [i for i, p in enumerate(u.params) if id(p) in float8 | experts]
        self.dense = [i for i in self.f8 if id(u.params[i]) not in experts]
        self.experts = [i for i in self.f8 if id(u.params[i]) in experts]
        self.hp = [i for i in range(len(u.params)) if i not in self.f8]
        # rank r's share of the other parameters: (param, shard start, shard end, param start) in order
        self.shares = [[u.piece(i, r) for i in self.hp if u.piece(i, r).start < u.piece(i, r).end]
                       for r in range(u.comm.size)]
        self.width = max([sum(s.end - s.start for s in share) for share in self.shares] + [0])
        self.offsets, off = {}, 0
        for i in self.hp:
            self.offsets[i], off = off, off + u.numels[i]
        self.full8 = torch.empty(u.padded, dtype=torch.uint8, device=u.device)
        self.codes = {i: _alias(self.full8, u.offsets[i], u.shapes[i], E4M3 if i in self.experts else dtype)
                      for i in self.f8}
        self.full8.untyped_storage().resize_(0)
        self.hp_full = torch.empty(off, dtype=u.dtype, device=u.device)
        self.scales: torch.Tensor | None = None  # this gather's, one per dense float8 weight
        self.rows: dict[int, torch.Tensor] = {}  # this gather's dequantising scales per expert weight
        self.cols = False  # the expert codes' orientation: per input column (backward) or output row


class Float8Gather:
    """The float8 gathers of the units that hold any of `float8` (parameter ids, tensorwise) or of
    `experts` (routed experts' weights, row-wise); `dtype`: the tensorwise weights' float8 dtype
    (torchao's config: e4m3; the experts' is e4m3, the only one a float8 grouped GEMM takes)."""

    def __init__(self, units: list[Unit], float8: set[int], dtype: torch.dtype, experts: frozenset[int] = frozenset()):
        self.dtype = dtype
        self.plans = {id(u): _UnitPlan(u, set(float8), dtype, set(experts)) for u in units
                      if any(id(p) in float8 or id(p) in experts for p in u.params)}
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

    def gather(self, u: Unit, cols: bool = False) -> Handle:
        """Start the unit's gather (scales, float8 codes, the other parameters); the handle's wait
        finishes it. `cols`: the experts' codes for the input gradient (backward), else the forward's."""
        g, shard = self.plans[id(u)], u.shard
        dense = [u.pieces[i] for i in g.dense]
        slabs = [_Slabs(shard, u.pieces[i], u.shapes[i], cols) for i in g.experts]
        parts = [torch.stack([amax(shard[s.start:s.end]) for s in dense])] if dense else []
        maxed = shared_amax(torch.cat(parts + [s.amax() for s in slabs]), u.comm)  # one all-reduce
        g.scales, g.cols = scales_of(maxed[:len(dense)], self.dtype), cols
        mine = torch.empty(u.shard_size, dtype=torch.uint8, device=u.device)
        for j, s in enumerate(dense):
            if s.start < s.end:
                encode(shard[s.start:s.end], g.scales[j], self.dtype, out=mine[s.start:s.end])
        at = len(dense)
        for i, sl in zip(g.experts, slabs):
            mult = pow2_scales(maxed[at:at + sl.count])  # fp8_grouped's rule: the GEMM's very scales
            at += sl.count
            g.rows[i] = mult.reciprocal().view(sl.shape[0], -1)
            sl.encode(mult, mine)
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
        return g.codes[g.f8[j]], g.scales[g.dense.index(g.f8[j])]

    @eager_under_compile
    def expert_weight(self, p: torch.Tensor, cols: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered e4m3 codes of expert weight `p` ([E, out, in]) cast per output row (cols False)
        or per input column, and their dequantising scales ([E, out] / [E, in]): `Float8Gemms.source`.
        Gathered the other way, the unit is gathered again (same bytes, the orientation asked for)."""
        u, j = self.where[id(p)]
        g = self.plans[id(u)]
        if g.cols != cols:
            self.gather(u, cols).wait()
        return g.codes[g.f8[j]], g.rows[g.f8[j]]


class _Slabs:
    """This rank's piece of an expert weight [E, out, in], zero-padded to the whole rows (cols False) or
    whole experts (cols True) it touches, so that the rows' (columns') partial amaxes and the cast with
    their shared scales are plain reductions and broadcasts (zeros never decide a MAX)."""

    def __init__(self, shard: torch.Tensor, seg: Segment, shape: tuple[int, ...], cols: bool):
        e, r, c = shape
        self.shape, self.cols, self.seg = shape, cols, seg
        self.count = e * c if cols else e * r  # one amax per (expert, column) or (expert, row)
        n, block = seg.end - seg.start, r * c if cols else c
        self.lo, hi = seg.param_start // block, -(-(seg.param_start + n) // block)
        self.off = seg.param_start - self.lo * block
        pad = shard.new_zeros((hi - self.lo) * block)
        pad[self.off:self.off + n] = shard[seg.start:seg.end]
        self.slab = pad.view(hi - self.lo, r, c) if cols else pad.view(hi - self.lo, c)

    def amax(self) -> torch.Tensor:
        """The partial amaxes of every row (column) of the weight, 0 where this piece has none (fp32)."""
        out = torch.zeros(self.count, dtype=torch.float32, device=self.slab.device)
        if self.seg.start < self.seg.end:
            part = self.slab.abs().amax(dim=1).float()
            width = part[0].numel()
            out[self.lo * width:self.lo * width + part.numel()] = part.reshape(-1)
        return out

    def encode(self, mult: torch.Tensor, out: torch.Tensor) -> None:
        """Cast the piece with the quantising multipliers `mult` (one per row / column) into its bytes of `out`."""
        s, n = self.seg, self.seg.end - self.seg.start
        if not n:
            return
        k = len(self.slab)
        scale = mult.view(-1, 1, self.shape[2])[self.lo:self.lo + k] if self.cols else mult[self.lo:self.lo + k, None]
        out[s.start:s.end] = encode(self.slab, scale, E4M3).reshape(-1)[self.off:self.off + n]


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
