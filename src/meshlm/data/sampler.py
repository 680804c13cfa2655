"""Deterministic global batches, independent of how they are split across ranks.

The global batch for a step depends only on (seed, step, seq_len, global_batch,
number of windows); each data-parallel rank takes a contiguous slice of it. So a
run on 1 process and on any DP/TP/PP layout sees exactly the same samples per
step, which is what lets different layouts be compared loss-for-loss.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["GlobalBatchSampler", "eval_batches", "EPOCH_SEED_STRIDE"]

EPOCH_SEED_STRIDE = 1_000_003
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF  # torch.Generator.manual_seed accepts 64-bit seeds


def _windows(shards, ids, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack windows [i*L, i*L+L+1) into (inputs, targets) shifted by one."""
    rows = np.stack([shards.get(i * seq_len, seq_len + 1) for i in ids]) if len(ids) else \
        np.empty((0, seq_len + 1), dtype=np.int64)
    x = torch.from_numpy(rows)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class GlobalBatchSampler:
    """Endless sequence of per-epoch permutations of the token windows."""

    def __init__(self, num_tokens: int, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1:
            raise ValueError(f"data: seq_len must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise ValueError(f"data: global_batch must be >= 1, got {global_batch}")
        self.num_tokens = int(num_tokens)
        self.seq_len = int(seq_len)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.num_windows = (self.num_tokens - 1) // self.seq_len
        if self.num_windows < 1:
            raise ValueError(f"data: corpus too small for seq_len {seq_len} "
                             f"({num_tokens} tokens)")
        self.step = 0
        self._perms: dict[int, list[int]] = {}

    @classmethod
    def for_shards(cls, shards, seq_len: int, global_batch: int, seed: int) -> "GlobalBatchSampler":
        return cls(len(shards), seq_len, global_batch, seed)

    def epoch_permutation(self, epoch: int) -> list[int]:
        """Window order of `epoch` (cached: consecutive steps reuse it)."""
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed((self.seed * EPOCH_SEED_STRIDE + epoch) & _SEED_MASK)
            perm = torch.randperm(self.num_windows, generator=g).tolist()
            if len(self._perms) >= 2:  # a batch spans at most a few epochs; keep it small
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def epoch_of(self, step: int) -> int:
        return (int(step) * self.global_batch) // self.num_windows

    def indices(self, step: int) -> list[int]:
        """Window ids of global batch `step` (may cross an epoch boundary)."""
        if step < 0:
            raise ValueError(f"data: step must be >= 0, got {step}")
        n, out = self.num_windows, []
        pos, end = int(step) * self.global_batch, (int(step) + 1) * self.global_batch
        while pos < end:
            epoch, k = divmod(pos, n)
            take = min(end - pos, n - k)
            out.extend(self.epoch_permutation(epoch)[k:k + take])
            pos += take
        return out

    def _check_dp(self, dp_rank: int, dp_size: int) -> int:
        if dp_size < 1 or self.global_batch % dp_size != 0:
            raise ValueError(f"data: global_batch {self.global_batch} is not divisible "
                             f"by data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data: dp_rank {dp_rank} out of range for dp_size {dp_size}")
        return self.global_batch // dp_size

    def batch(self, shards, step: int, dp_rank: int = 0, dp_size: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous slice of global batch `step` as (inputs, targets)."""
        local = self._check_dp(dp_rank, dp_size)
        if len(shards) < self.num_windows * self.seq_len + 1:
            raise ValueError(f"data: shards hold {len(shards)} tokens but the sampler "
                             f"was built for {self.num_tokens}")
        ids = self.indices(step)[dp_rank * local:(dp_rank + 1) * local]
        return _windows(shards, ids, self.seq_len)

    def next_batch(self, shards, dp_rank: int = 0, dp_size: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(shards, self.step, dp_rank, dp_size)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        """`step` is the next step to be consumed."""
        return {"step": int(self.step)}

    def load_state_dict(self, state: dict) -> None:
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"data: invalid sampler step {step}")
        self.step = step


def eval_batches(val_shards, seq_len: int, batch: int, n_batches: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first windows of the val split, in order: identical on every rank.

    Returns up to `n_batches` full batches; if the split holds fewer than `batch`
    windows, one smaller batch with all of them.
    """
    if seq_len < 1 or batch < 1 or n_batches < 1:
        raise ValueError("data: eval seq_len, batch and n_batches must be >= 1")
    n_windows = (len(val_shards) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"data: val split too small for seq_len {seq_len} "
                         f"({len(val_shards)} tokens)")
    if n_windows < batch:
        return [_windows(val_shards, list(range(n_windows)), seq_len)]
    count = min(n_batches, n_windows // batch)
    return [_windows(val_shards, list(range(b * batch, (b + 1) * batch)), seq_len)
            for b in range(count)]
