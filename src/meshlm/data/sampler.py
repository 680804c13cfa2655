"""Deterministic global batches, independent of how they are split across ranks.

The global batch of a step depends only on (seed, step, seq_len, global_batch, number of windows,
training.batch_rampup); each data-parallel rank takes a contiguous slice of it. Step t reads the
window stream from its consumed-sample offset (`BatchRamp.consumed`: t·global_batch without a ramp). So a run on 1 process and on any layout sees
exactly the same samples per step, which is what lets layouts be compared loss-for-loss.

The per-epoch shuffle is a stateless bijection (`WindowOrder`: a Feistel network with cycle walking),
computed per index: O(1) memory and start-up whatever the corpus size (docs/data.md).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..core.facts.ramp import BatchRamp

__all__ = ["WindowOrder", "GlobalBatchSampler", "MixtureSampler", "Batch", "apportion", "eval_batches"]

_M64 = (1 << 64) - 1
_ROUNDS = 4


def _splitmix(x: int) -> int:
    """A 64-bit mixer (splitmix64's finaliser) on Python ints: round keys from (seed, epoch, round)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _key(*parts: int) -> int:
    k = 0
    for p in parts:
        k = _splitmix(k ^ (int(p) & _M64))
    return k


def _mix(x: np.ndarray) -> np.ndarray:
    """The same mixer on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class WindowOrder:
    """Epoch e's order of windows 0..n-1: a pseudo-random permutation evaluated index by index.

    A balanced Feistel network over 2·h bits (2^(2h) >= n) is a bijection of [0, 2^(2h)); values that
    land at or above n are encrypted again (cycle walking) until they fall inside, which keeps it a
    bijection of [0, n). Expected walks per index < 4; nothing is stored."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"data: need at least one window, got {n}")
        self.n, self.seed = int(n), int(seed)
        self.half = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half) - 1)

    def _encrypt(self, x: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self._mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << h) | right

    def permute(self, epoch: int, idx: np.ndarray) -> np.ndarray:
        """Window ids at positions `idx` (each in [0, n)) of epoch `epoch`'s order."""
        keys = [np.uint64(_key(self.seed, epoch, r)) for r in range(_ROUNDS)]
        y = self._encrypt(np.asarray(idx, dtype=np.uint64), keys)
        out = y >= np.uint64(self.n)
        while out.any():
            y[out] = self._encrypt(y[out], keys)
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)

    def take(self, pos: int, count: int) -> np.ndarray:
        """Window ids at stream positions [pos, pos+count) of the endless sequence of epochs."""
        parts, pos, end = [], int(pos), int(pos) + int(count)
        while pos < end:
            epoch, k = divmod(pos, self.n)
            step = min(end - pos, self.n - k)
            parts.append(self.permute(epoch, np.arange(k, k + step, dtype=np.uint64)))
            pos += step
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class Batch(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor
    docs: torch.Tensor | None  # per input token: its document within the sequence (document masking)


def _windows(reads: list[tuple[object, int]], seq_len: int, docs: bool) -> Batch:
    """(shards, window id) pairs -> inputs/targets shifted by one (and per-token document ids)."""
    if not reads:
        empty = torch.empty((0, seq_len), dtype=torch.int64)
        return Batch(empty, empty.clone(), empty.clone() if docs else None)
    rows = torch.from_numpy(np.stack([s.get(i * seq_len, seq_len + 1) for s, i in reads]))
    ids = torch.from_numpy(np.stack([s.doc_ids(i * seq_len, seq_len) for s, i in reads])) if docs else None
    return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), ids)


def _dp_slice(global_batch: int, dp_rank: int, dp_size: int, rows: tuple[int, ...] = ()) -> slice:
    """Rank `dp_rank`'s contiguous run of the global batch: equal runs, or `rows[r]` sequences each
    (parallel.dp_weights)."""
    if rows:
        if len(rows) != dp_size or sum(rows) != global_batch or not 0 <= dp_rank < dp_size:
            raise ValueError(f"data: rows {list(rows)} of dp rank {dp_rank} do not split global_batch {global_batch} "
                             f"over {dp_size} ranks")
        start = sum(rows[:dp_rank])
        return slice(start, start + rows[dp_rank])
    if dp_size < 1 or global_batch % dp_size != 0:
        raise ValueError(f"data: global_batch {global_batch} is not divisible by data-parallel size {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data: dp_rank {dp_rank} out of range for dp_size {dp_size}")
    local = global_batch // dp_size
    return slice(dp_rank * local, (dp_rank + 1) * local)


class GlobalBatchSampler:
    """Endless sequence of per-epoch permutations of one split's windows; `step` is the data position
    (the samples it has consumed follow from it: `ramp.consumed(step)`)."""

    def __init__(self, num_tokens: int, seq_len: int, global_batch: int, seed: int, rampup: list[int] = ()):
        if seq_len < 1:
            raise ValueError(f"data: seq_len must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise ValueError(f"data: global_batch must be >= 1, got {global_batch}")
        self.num_tokens, self.seq_len = int(num_tokens), int(seq_len)
        self.global_batch, self.seed = int(global_batch), int(seed)
        self.num_windows = (self.num_tokens - 1) // self.seq_len
        if self.num_windows < 1:
            raise ValueError(f"data: corpus too small for seq_len {seq_len} ({num_tokens} tokens)")
        self.order = WindowOrder(self.num_windows, self.seed)
        self.ramp = BatchRamp(self.global_batch, rampup)
        self.step = 0

    @classmethod
    def for_shards(cls, shards, seq_len: int, global_batch: int, seed: int,
                   rampup: list[int] = ()) -> "GlobalBatchSampler":
        return cls(len(shards), seq_len, global_batch, seed, rampup)

    def batch_size(self, step: int | None = None) -> int:
        """Sequences in global batch `step` (default: the next one to be consumed)."""
        return self.ramp.batch(self.step if step is None else step)

    def epoch_permutation(self, epoch: int) -> list[int]:
        """The whole order of `epoch` (small corpora and tests only: it is n ints)."""
        return self.order.permute(epoch, np.arange(self.num_windows, dtype=np.uint64)).tolist()

    def epoch_of(self, step: int) -> int:
        return self.ramp.consumed(step) // self.num_windows

    def indices(self, step: int) -> list[int]:
        """Window ids of global batch `step` (may cross an epoch boundary)."""
        if step < 0:
            raise ValueError(f"data: step must be >= 0, got {step}")
        return self.order.take(self.ramp.consumed(step), self.ramp.batch(step)).tolist()

    def batch(self, shards, step: int, dp_rank: int = 0, dp_size: int = 1, docs: bool = False,
              rows: tuple[int, ...] = ()) -> Batch:
        """This rank's contiguous slice of global batch `step` (`rows`: uneven slices, `_dp_slice`)."""
        part = _dp_slice(self.ramp.batch(step), dp_rank, dp_size, rows)
        if len(shards) < self.num_windows * self.seq_len + 1:
            raise ValueError(f"data: shards hold {len(shards)} tokens but the sampler was built for "
                             f"{self.num_tokens}")
        return _windows([(shards, i) for i in self.indices(step)[part]], self.seq_len, docs)

    def next_batch(self, shards, dp_rank: int = 0, dp_size: int = 1, docs: bool = False,
                   rows: tuple[int, ...] = ()) -> Batch:
        out = self.batch(shards, self.step, dp_rank, dp_size, docs, rows)
        self.step += 1
        return out

    def drawn(self) -> dict[str, int] | None:
        return None

    def state_dict(self) -> dict:
        """`step` is the next step to be consumed; under training.batch_rampup also `samples`, the
        sequences consumed before it (for readers: it follows from the step and the ramp)."""
        out = {"step": int(self.step)}
        if self.ramp.ramp_steps:
            out["samples"] = int(self.ramp.consumed(self.step))
        return out

    def load_state_dict(self, state: dict) -> None:
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"data: invalid sampler step {step}")
        self.step = step


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` seats by weight (largest remainder, ties to the earlier source): the fixed number of
    sequences each source gives every global batch."""
    w = np.asarray(weights, dtype=np.float64)
    quota = total * w / w.sum()
    seats = np.floor(quota).astype(np.int64)
    order = sorted(range(len(w)), key=lambda k: (-(quota[k] - seats[k]), k))
    for k in order[:total - int(seats.sum())]:
        seats[k] += 1
    return seats.tolist()


class MixtureSampler:
    """Several prepared sets with weights: every global batch holds `counts[k]` sequences of source k
    (apportion), each source walking its own epochs; a per-step shuffle of the slots spreads the
    sources over the data-parallel ranks. Deterministic per step, so identical in every layout and
    resumable across layouts from the step alone. Under training.batch_rampup each batch size is
    apportioned alike and each source goes on from the sequences it gave the steps before."""

    def __init__(self, sizes: list[int], names: list[str], weights: list[float], seq_len: int,
                 global_batch: int, seed: int, rampup: list[int] = ()):
        self.counts = apportion(global_batch, weights)
        empty = [n for n, c in zip(names, self.counts) if c == 0]
        if empty:
            raise ValueError(f"data.mix: source {empty[0]} gets 0 of {global_batch} sequences per step at its "
                             f"weight (raise its weight or training.global_batch)")
        self.names, self.seq_len, self.global_batch = list(names), int(seq_len), int(global_batch)
        self.parts = [GlobalBatchSampler(n, seq_len, c, _key(seed, k) >> 1)
                      for k, (n, c) in enumerate(zip(sizes, self.counts))]
        self.slot_seed = _key(seed, len(sizes), 1) >> 1
        self.ramp = BatchRamp(self.global_batch, rampup)
        self.level_counts = [apportion(lv.batch, weights) for lv in self.ramp.levels]  # a ramp's smaller
        self.step = 0  # batches may give a light source none

    def given(self, step: int) -> list[int]:
        """Sequences each source gave the steps before `step` (one term per batch size of the ramp)."""
        out = [0] * len(self.parts)
        for lv, end, counts in zip(self.ramp.levels, [lv.step for lv in self.ramp.levels[1:]] + [step],
                                   self.level_counts):
            n = max(0, min(step, end) - lv.step)
            out = [o + n * c for o, c in zip(out, counts)]
        return out

    def batch(self, shards: list, step: int, dp_rank: int = 0, dp_size: int = 1, docs: bool = False,
              rows: tuple[int, ...] = ()) -> Batch:
        size = self.ramp.batch(step)
        counts = self.level_counts[self.ramp.index(step)]
        part = _dp_slice(size, dp_rank, dp_size, rows)
        reads = [(shards[k], i) for k, (p, at, c) in enumerate(zip(self.parts, self.given(step), counts))
                 for i in p.order.take(at, c).tolist()]
        order = WindowOrder(size, self.slot_seed).permute(step, np.arange(size, dtype=np.uint64))
        return _windows([reads[j] for j in order[part]], self.seq_len, docs)

    def next_batch(self, shards: list, dp_rank: int = 0, dp_size: int = 1, docs: bool = False,
                   rows: tuple[int, ...] = ()) -> Batch:
        out = self.batch(shards, self.step, dp_rank, dp_size, docs, rows)
        self.step += 1
        return out

    def drawn(self) -> dict[str, int]:
        """Tokens drawn from each source so far (inputs of every consumed step)."""
        return {n: g * self.seq_len for n, g in zip(self.names, self.given(self.step))}

    batch_size = GlobalBatchSampler.batch_size
    state_dict = GlobalBatchSampler.state_dict
    load_state_dict = GlobalBatchSampler.load_state_dict


def eval_batches(val, seq_len: int, batch: int, n_batches: int, weights: list[float] | None = None,
                 docs: bool = False) -> list[Batch]:
    """The first windows of the val split(s), in order: identical on every rank. `val` is one split, or
    a list of them with `weights` (a mixture: each batch apportioned like a training batch).

    Returns up to `n_batches` full batches; if a split holds fewer windows than it is asked for, one
    smaller batch with all the windows there are."""
    if seq_len < 1 or batch < 1 or n_batches < 1:
        raise ValueError("data: eval seq_len, batch and n_batches must be >= 1")
    splits = list(val) if isinstance(val, (list, tuple)) else [val]
    counts = apportion(batch, weights) if weights else [batch]
    have = [(len(s) - 1) // seq_len for s in splits]
    for s, h in zip(splits, have):
        if h < 1:
            raise ValueError(f"data: val split too small for seq_len {seq_len} ({len(s)} tokens)")
    full = min(h // c for h, c in zip(have, counts) if c) if any(counts) else 0
    if full < 1:
        return [_windows([(s, i) for s, h in zip(splits, have) for i in range(h)], seq_len, docs)]
    return [_windows([(s, b * c + i) for s, c in zip(splits, counts) for i in range(c)], seq_len, docs)
            for b in range(min(n_batches, full))]
