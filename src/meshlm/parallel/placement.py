"""One placement record per parameter: how the single-process tensor is laid out over the mesh.

`parallelize()` builds a `Placement` for every parameter this rank holds, adding to it as each dimension
is applied: the pipeline decides whether the rank holds it at all (and which copy of a tied weight is
the spare one), tensor parallelism cuts rectangular slices along one dimension (`DimSplit`, with the
vocabulary padding and kv-head replication), ZeRO takes a contiguous range of the flattened slice
(`FlatRange`), and every dimension that leaves copies adds a replica index. Everything that used to be
patched per dimension derives from this one record:

- `to_local(full)`: this rank's piece of any parameter-shaped tensor (initial values, HF weights);
- `boxes()`: the rectangles of the full tensor that the piece covers, with where each one starts in the
  rank's flat storage, which is what a sharded checkpoint hands to DCP (train/checkpoint/);
- `owner`: whether this rank is the one copy that counts: it writes the checkpoint pieces and adds
  its gradient to the global norm, so every element is written and counted exactly once over the world.

Why not DTensor: ZeRO keeps a unit's parameters in one flat buffer cut into equal ranges (one
collective per unit, see zero/units.py), and such a range of a 2-D weight is not a DTensor shard. A
flat range of a row-major tensor is always a union of at most 2·ndim-1 rectangles, though, so the
record keeps the range and `boxes()` decomposes it; DCP only needs rectangles with offsets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class DimSplit:
    """Dimension `dim` (single-process size `size`, padded to `padded`) cut into `parts` equal chunks
    over the comm `comm`; this rank holds chunk `index`."""
    dim: int
    size: int
    padded: int
    parts: int
    index: int
    comm: str

    @property
    def chunk(self) -> int:
        return self.padded // self.parts

    @property
    def start(self) -> int:
        """First index of this rank's chunk in the (padded) dimension: a vocabulary slice's first id,
        an expert slice's first expert."""
        return self.index * self.chunk

    @property
    def real(self) -> int:
        """How many of the chunk's indices exist in the single-process tensor (the rest is padding)."""
        return max(0, min(self.chunk, self.size - self.start))


@dataclass(frozen=True)
class FlatRange:
    """This rank's elements [start, end) of the flattened local (split) tensor, over comm `comm`."""
    start: int
    end: int
    comm: str


@dataclass(frozen=True)
class Box:
    """A rectangle of the full tensor held here: `offsets`/`sizes` in full coordinates, and where its
    elements start in the rank's flat storage (row-major, contiguous). `local_sizes` is the rectangle
    as stored; `sizes` can be smaller where vocabulary padding is cut off the end."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: int
    local_sizes: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    name: str
    full_shape: tuple[int, ...]
    splits: tuple[DimSplit, ...] = ()
    flat: FlatRange | None = None
    replicas: tuple[tuple[str, int], ...] = ()  # (comm, this rank's index among identical copies)

    # -- building (one call per dimension) ------------------------------------------------------
    def split(self, s: DimSplit) -> "Placement":
        return replace(self, splits=self.splits + (s,))

    def shard_flat(self, start: int, end: int, comm: str) -> "Placement":
        return replace(self, flat=FlatRange(start, end, comm))

    def replicate(self, comm: str, index: int) -> "Placement":
        return replace(self, replicas=self.replicas + ((comm, index),))

    # -- derived ---------------------------------------------------------------------------------
    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the split (unflattened) tensor this rank's storage is a range of."""
        shape = list(self.full_shape)
        for s in self.splits:
            shape[s.dim] = s.chunk
        return tuple(shape)

    @property
    def owner(self) -> bool:
        return all(i == 0 for _, i in self.replicas)

    @property
    def numel(self) -> int:
        """Elements in this rank's storage of the parameter."""
        if self.flat is not None:
            return self.flat.end - self.flat.start
        return math.prod(self.local_shape)

    @torch.no_grad()
    def to_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full single-process tensor (a new tensor; flat under ZeRO)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"{self.name}: shape {tuple(full.shape)} does not match {self.full_shape}")
        t = full
        for s in self.splits:
            if s.padded > t.shape[s.dim]:
                pad = list(t.shape)
                pad[s.dim] = s.padded - t.shape[s.dim]
                t = torch.cat([t, t.new_zeros(pad)], dim=s.dim)
            t = t.narrow(s.dim, s.start, s.chunk)
        if self.flat is not None:
            return t.reshape(-1)[self.flat.start:self.flat.end].clone()
        return t.contiguous().clone()

    def boxes(self) -> list[Box]:
        """The rectangles of the full tensor in this rank's storage (padding cut off)."""
        local = self.local_shape
        start, end = (self.flat.start, self.flat.end) if self.flat is not None else (0, math.prod(local))
        origin = [0] * len(local)
        for s in self.splits:
            origin[s.dim] += s.start
        out = []
        for offs, sizes, flat in flat_boxes(local, start, end):
            full_offs = tuple(o + g for o, g in zip(offs, origin))
            cut = tuple(max(0, min(sz, f - o)) for o, sz, f in zip(full_offs, sizes, self.full_shape))
            if all(cut):
                out.append(Box(full_offs, cut, flat - start, tuple(sizes)))
        return out

    def pieces(self, storage: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
        """(box, view of `storage`) for each box; `storage` is this rank's tensor of the parameter
        (any shape with `numel` elements, contiguous). Views, so loading writes in place."""
        flat = storage.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"{self.name}: storage has {flat.numel()} elements, placement says {self.numel}")
        out = []
        for b in self.boxes():
            n = math.prod(b.local_sizes)
            v = flat[b.flat:b.flat + n].view(b.local_sizes)
            for d, (have, keep) in enumerate(zip(b.local_sizes, b.sizes)):
                if keep != have:
                    v = v.narrow(d, 0, keep)
            out.append((b, v))
        return out

    def describe(self) -> str:
        parts = [f"{s.comm}[dim {s.dim}: {s.index}/{s.parts}]" for s in self.splits]
        if self.flat is not None:
            parts.append(f"{self.flat.comm}[flat {self.flat.start}:{self.flat.end}]")
        parts += [f"{c}#{i}" for c, i in self.replicas]
        return f"{self.name} {self.full_shape}: " + (", ".join(parts) or "whole")


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Decompose the flat range [start, end) of a row-major `shape` into rectangles, in order:
    (offsets, sizes, flat start). At most 2·ndim - 1 of them."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (end - start,) if shape else (), start)]
    inner = math.prod(shape[1:])
    out = []
    row = start // inner
    if start % inner:  # a partial first row
        stop = min(end, (row + 1) * inner)
        for o, s, f in flat_boxes(shape[1:], start - row * inner, stop - row * inner):
            out.append(((row,) + o, (1,) + s, row * inner + f))
        start, row = stop, row + 1
    full_rows = (end - start) // inner
    if full_rows > 0:
        out.append(((row,) + (0,) * (len(shape) - 1), (full_rows,) + tuple(shape[1:]), start))
        start, row = start + full_rows * inner, row + full_rows
    if start < end:  # a partial last row
        for o, s, f in flat_boxes(shape[1:], 0, end - start):
            out.append(((row,) + o, (1,) + s, row * inner + f))
    return out


@dataclass
class PlacementTable:
    """Placements of every parameter this rank holds, by single-process name."""
    records: dict[str, Placement] = field(default_factory=dict)

    def add(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.records:
            self.records[name] = Placement(name, tuple(shape))

    def update(self, name: str, fn) -> None:
        self.records[name] = fn(self.records[name])

    def __getitem__(self, name: str) -> Placement:
        return self.records[name]

    def __contains__(self, name: str) -> bool:
        return name in self.records

    def names(self) -> list[str]:
        return list(self.records)

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return self.records[name].to_local(full)

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self.records.values())
